"""Garbage collection that keeps out of the event loop's way while rollouts run.

Owns: `QuietGC`, the process's collection policy while episodes are in flight (the older heap frozen,
automatic collection off, one collection of what the rollouts left when the last of them ends, a
collection anyway when too much piles up), and `ROLLOUT_GC`, the one instance every rollout of this
process enters: the switch is process-wide, so overlapping rollouts must share its count.
Does not own: the rollouts (`rollout.engine` while it has work in flight, and a rollout worker while it plays,
enter `ROLLOUT_GC.quiet()` and call `collect_if_piling_up` after each episode).

Why: a collection walks every live object of the generations it collects, and while thousands of
episodes are in flight most live objects are theirs (coroutines, messages, token lists). With
Python's default thresholds they get promoted and drive full collections every few seconds; with
rarer young collections (50,000 allocations) a young collection still met the episodes' live objects and
stopped the event loop for far longer than a turn (bench/runner_scale.py, 4,096 episodes:
docs/performance.md#the-runner-at-scale-by-simulation). Reference counting
frees almost everything a turn makes; what it cannot free (reference cycles) waits for the end or
for point 3. So, while a rollout runs:
1. the heap that existed before (model, tokenizer, modules: ~370k objects) is frozen (gc.freeze),
   so that the collection at the end walks only what the rollouts made; a caller's own freeze is
   left alone;
2. automatic collection is off (the caller's setting is restored after);
3. a worker that finds `collect_above` more objects alive than at the last collection collects the
   young generations anyway (an environment that makes cycles must not grow memory unbounded);
4. at the end: unfreeze, collect generations 0-1 (the rollouts' survivors and their cycles, not the
   older heap), restore. No episode of this rollout is in flight then.
The switch is process-wide: a policy update that overlaps a rollout (the training run's stream,
`rollout.stream`, at `algorithm.max_staleness` > 0) runs without automatic collection too, its cycles
collected when no episode is in flight any more (or by point 3).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


class QuietGC:
    """The collection policy of the rollouts of one process; `quiet()` nests (overlapping rollouts):
    the first to enter switches collection off, the last to leave collects and restores."""

    def __init__(self, collect_above: int = 2_000_000):
        self.collect_above = collect_above  # objects allocated (net) without a collection before a worker collects
        self.rollouts = 0  # rollouts in progress
        self._was_enabled = False  # the caller's automatic collection, restored when the last rollout ends
        self._froze = False  # whether the first rollout froze the heap (a caller's own freeze is left alone)

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Points 1, 2 and 4 of the module's doc around one rollout."""
        if self.rollouts == 0:
            self._was_enabled, self._froze = gc.isenabled(), gc.get_freeze_count() == 0
            if self._froze:
                gc.freeze()
            gc.disable()
        self.rollouts += 1
        try:
            yield
        finally:
            self.rollouts -= 1
            if self.rollouts == 0:
                if self._froze:
                    gc.unfreeze()
                gc.collect(1)
                if self._was_enabled:
                    gc.enable()

    def collect_if_piling_up(self) -> None:
        """Point 3: a collection of the young generations when too much has piled up."""
        if gc.get_count()[0] > self.collect_above:
            gc.collect(1)


ROLLOUT_GC = QuietGC()  # shared by every rollout of this process
