"""Admission by staleness: which group slots may start, and which of them a training step may take.

Owns: `Admission`, the bookkeeping of a run's group slots under `algorithm.max_staleness` k and
`algorithm.sample_ahead` a, and its one invariant; the version each open slot opened at and its deadline; the
JSON a checkpoint keeps of it.
Does not own: playing groups, tasks, refills (`rollout.stream`), the loop (`trainer`).

Slots. A run trains `steps` x B groups (B = `rollout.tasks_per_step`); slot n (0, 1, 2, ...) is the place
of the n-th of them, *for* step n // B (its target: the label its requests' seeds are drawn from). A slot holds
one group at a time: a group without signal frees its place for another task (`rollout.stream`), the slot
stays. The invariant, one line:

    a slot opened at version v is trained at a step <= v + k (its deadline).

So every token a step trains was sampled by a version at most k behind it, and no slot is dropped for
age: the trainer waits for a slot at its deadline instead.
- Opening (`open_up_to`): at most B + A slots open beyond those trained (A = `ahead`: a x B, 0 <= A <= k x B):
  opened <= (version + 1) x B + A, so slot n opens at version max(0, (n - A) // B). With A = k x B (the default)
  that is SkyRL's rule, opened <= (k + 1 + version) x B, and slot n's deadline is max(k, n // B). A smaller A
  keeps fewer groups waiting and so lowers the lag a step trains at (about A / B versions, less the turns played
  after a push), at the cost of fewer episodes playing; the deadline stays k versions after the opening, so a
  slow group still has k versions to end in before the trainer waits for it.
- Taking (`choose`): step s takes B slots whose groups have ended, earliest deadline first (then the
  oldest), and only a set that keeps every later deadline reachable: for every step d >= s, the slots
  still open with deadline <= d fit into steps s + 1 .. d, i.e. number at most (d - s) x B. Otherwise
  it waits for more groups to end. Once every open slot has ended such a set exists: the slots with deadline
  <= d opened at versions <= d - k, so number at most (d - k + 1) x B + A - s x B <= (d - s + 1) x B.
At k = 0 (so A = 0) slot n opens at version n // B and is trained at step n // B: the synchronous loop, exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Admission:
    """The slots of a run: how many have opened (ids 0 .. opened - 1) and, for those not yet trained, the
    version each opened at."""

    batch: int  # B: slots per step
    staleness: int  # k
    steps: int  # the run's steps: slots exist for steps 0 .. steps - 1 only
    slots_ahead: int | None = None  # A: slots open beyond the current step's, 0 .. k x B; None: k x B
    opened: int = 0
    open: dict[int, int] = field(default_factory=dict)  # opened and not yet taken by a step -> version opened at

    def __post_init__(self) -> None:
        if not 0 <= self.ahead <= self.staleness * self.batch:
            raise ValueError(f"slots_ahead: 0 .. k x B = {self.staleness * self.batch}, got {self.ahead}")

    @property
    def ahead(self) -> int:
        """A: how many slots may be open beyond the B of the step being trained."""
        return self.staleness * self.batch if self.slots_ahead is None else self.slots_ahead

    def target(self, slot: int) -> int:
        """The step a slot is for (its seeds' label)."""
        return slot // self.batch

    def deadline(self, slot: int) -> int:
        """The last step that may train an open slot: k versions after it opened."""
        return self.open[slot] + self.staleness

    def open_up_to(self, version: int) -> range:
        """Open every slot that servers sampling with `version` may start (oldest first); returns them."""
        limit = min((version + 1) * self.batch + self.ahead, self.steps * self.batch)
        new = range(self.opened, max(self.opened, limit))
        self.open.update(dict.fromkeys(new, version))
        self.opened = new.stop
        return new

    def choose(self, step: int, ended: Iterable[int]) -> list[int] | None:
        """The slots step `step` trains, oldest first, among those whose groups have `ended`; None: wait."""
        due = sorted(self.open, key=lambda n: (self.deadline(n), n))
        pick = sorted((n for n in set(ended) if n in self.open), key=lambda n: (self.deadline(n), n))[: self.batch]
        if len(pick) < min(self.batch, len(self.open)):
            return None
        left, chosen = 0, set(pick)
        for i, n in enumerate(due):  # the slots left open, by deadline: each prefix must fit before its deadline
            left += n not in chosen
            last = i + 1 == len(due) or self.deadline(due[i + 1]) != self.deadline(n)
            if last and left > (self.deadline(n) - step) * self.batch:
                return None
        return sorted(pick)

    def take(self, slots: Iterable[int]) -> None:
        for n in slots:
            del self.open[n]

    def to_json(self) -> dict[str, Any]:
        return {"opened": self.opened, "open": sorted([n, v] for n, v in self.open.items())}

    @classmethod
    def from_json(cls, saved: dict[str, Any], batch: int, staleness: int, steps: int,
                  slots_ahead: int | None = None) -> Admission:
        """A checkpoint's slots (`to_json`); one whose open slots lack the version they opened at was written before
        agent-rl 0.1.0, and is refused in one line (`StaleCheckpoint`)."""
        if not isinstance(saved, dict) or "opened" not in saved or not all(
                isinstance(x, list) and len(x) == 2 for x in saved.get("open", [])):
            raise StaleCheckpoint("its stream state lists open slots without the version each opened at")
        opened = {int(n): int(v) for n, v in saved["open"]}
        return cls(batch, staleness, steps, slots_ahead, int(saved["opened"]), opened)


class StaleCheckpoint(ValueError):
    """A checkpoint written before agent-rl 0.1.0: its rollout stream's state cannot be resumed."""

    def __init__(self, why: str):
        super().__init__(f"checkpoint from before agent-rl 0.1.0: {why}; resume it with the version that wrote it, "
                         f"or start the run afresh without --resume")
