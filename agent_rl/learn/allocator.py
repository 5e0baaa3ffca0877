"""Keeping a CPU trainer's C heap near what its tensors use: within a step and between steps.

Owns: `cap_heap_buffers()`, called once when a CPU policy is built (`learn.policy.build_policy`), and
`release_freed_memory()`, called once per optimizer step (`update.optimizer_step`, used by GRPO and
SFT alike). Does not own: anything torch allocates on a GPU.

Why: a CPU trainer allocates activation buffers of a new shape at every micro-batch. glibc serves
buffers below its mmap threshold from the heap, and raises that threshold (up to 32 MB) each time a
larger mmap'd buffer is freed, so after a few steps most buffers live in the heap, where freed pages
stay resident. On the recipe, with `micro_batch_tokens: 4096`, the trainer's RSS grew step after step
until the OOM killer stopped it. `malloc_trim(0)` after each step hands every free heap page
back. `bench/allocator.py` measured it against a fixed 1 MB mmap threshold
(`MALLOC_MMAP_THRESHOLD_=1048576`, which also stops the growth): the trim frees about as much at a smaller
cost in step time than the threshold, which faults every large buffer in afresh, not once a step
(docs/performance.md#the-bench-scripts, the `bench/allocator.py` rows).

Within a step the trim cannot help: a forward and backward pass over a 4,096-token micro-batch of
SmolLM2-135M with gradient checkpointing keeps far less in saved tensors (counted with autograd's
saved-tensor hooks) than its peak RSS, because the hidden-state buffers that each checkpointed layer
recomputes come from the heap and freed ones are not reused in place.
`cap_heap_buffers` fixes glibc's mmap threshold at 4 MiB (no longer raised as buffers are freed), so
such buffers are mapped and unmapped whole. The price is time: every such buffer is faulted in
afresh. `bench/allocator.py --steps 2 --batch 13 --micro-batch-tokens 4096` (full micro-batches)
measured the peak and the step time against the trim alone (docs/performance.md#the-bench-scripts). On a CPU
the cap is on: a trainer that fits beside its vLLM server and other jobs was judged worth the slower step; on a
GPU the activations are not in this heap and no cap is set.
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _malloc_trim():
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc (musl, macOS): nothing to do
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
HEAP_BUFFER_CAP = 4 << 20


@functools.cache
def cap_heap_buffers() -> bool:
    """Serve every buffer of `HEAP_BUFFER_CAP` bytes or more by its own mapping, for the rest of the
    process (once; glibc only). True if glibc took the setting."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, HEAP_BUFFER_CAP))


def release_freed_memory() -> bool:
    """Return the heap's free pages to the OS now. True if glibc released any memory."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim else False
