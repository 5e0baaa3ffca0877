"""Admission by staleness: which group slots may start, and which of them a training step may take.

Owns: `Admission`, the bookkeeping of a run's group slots under `algorithm.max_staleness` k, and its one
invariant; a slot's target step and deadline; the JSON a checkpoint keeps of it.
Does not own: playing groups, tasks, refills (`rollout.stream`), the loop (`trainer`).

Slots. A run trains `steps` x B groups (B = `rollout.tasks_per_step`); slot n (0, 1, 2, ...) is the place
of the n-th of them, *for* step n // B (its target). A slot holds one group at a time: a group without
signal frees its place for another task (`rollout.stream`), the slot stays. The invariant, one line:

    slot n opens only once the servers sample with version n // B - k, and is trained at a step <= max(k, n // B).

So every token a step trains was sampled by a version at most k behind it, and no slot is dropped for
age: the trainer waits for a slot at its deadline instead.
- Opening (`open_up_to`): SkyRL's rule, opened <= (k + 1 + version) x B; slot n at version max(0, n // B - k).
- Taking (`choose`): step s takes B slots whose groups have ended, earliest deadline first (then the
  oldest), and only a set that keeps every later deadline reachable: for every step d >= s, the slots
  still open with deadline <= d fit into steps s + 1 .. d, i.e. number at most (d - s) x B. Otherwise
  it waits for more groups to end. Once every open slot has ended such a set exists (the invariant).
At k = 0 slot n opens at version n // B and is trained at step n // B: the synchronous loop, exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Admission:
    """The slots of a run: how many have opened (ids 0 .. opened - 1) and which of those are not yet trained."""

    batch: int  # B: slots per step
    staleness: int  # k
    steps: int  # the run's steps: slots exist for steps 0 .. steps - 1 only
    opened: int = 0
    open: set[int] = field(default_factory=set)  # opened and not yet taken by a step

    def target(self, slot: int) -> int:
        """The step a slot is for."""
        return slot // self.batch

    def deadline(self, slot: int) -> int:
        """The last step that may train it."""
        return max(self.staleness, slot // self.batch)

    def open_up_to(self, version: int) -> range:
        """Open every slot that servers sampling with `version` may start (oldest first); returns them."""
        limit = min((self.staleness + 1 + version) * self.batch, self.steps * self.batch)
        new = range(self.opened, max(self.opened, limit))
        self.open.update(new)
        self.opened = new.stop
        return new

    def choose(self, step: int, ended: Iterable[int]) -> list[int] | None:
        """The slots step `step` trains, oldest first, among those whose groups have `ended`; None: wait."""
        due = sorted(self.open, key=lambda n: (self.deadline(n), n))
        pick = sorted((n for n in set(ended) & self.open), key=lambda n: (self.deadline(n), n))[: self.batch]
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
        self.open.difference_update(slots)

    def to_json(self) -> dict[str, Any]:
        return {"opened": self.opened, "open": sorted(self.open)}

    @classmethod
    def from_json(cls, saved: dict[str, Any], batch: int, staleness: int, steps: int) -> Admission:
        return cls(batch, staleness, steps, int(saved["opened"]), {int(n) for n in saved["open"]})
