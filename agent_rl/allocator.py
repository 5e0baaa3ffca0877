"""How a training process asks the C allocator to give freed memory back.

Owns: one process-wide setting, applied explicitly by the commands that train (`agent-rl train`,
`agent-rl sft`), never on import. Does not own: anything torch allocates on a GPU.

Why: a CPU trainer allocates activation buffers of a new shape at every micro-batch. glibc serves
buffers below its mmap threshold from the heap, and raises that threshold (up to 32 MB) each time a
larger mmap'd buffer is freed, so after a few steps most buffers live in the heap, where a
fragmented top keeps freed pages resident. On the recipe, with `micro_batch_tokens: 4096`, the
trainer's RSS grew step after step to 19 GB and the OOM killer stopped it. A fixed 1 MB threshold
(what `MALLOC_MMAP_THRESHOLD_=1048576` sets at start-up) makes every large buffer its own mapping,
returned to the OS on free.
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def return_freed_memory_to_os(threshold_bytes: int = 1 << 20) -> bool:
    """Serve allocations of at least `threshold_bytes` from mmap for the rest of this process.
    True if the C library took the setting; False where there is no glibc `mallopt` (musl, macOS)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold_bytes) == 1
