"""The run's seeds: one per training step, one per sampling request, both derived from the run seed.

Owns: `step_seed` (a training step's: the policy update shuffles its mini-batches with it; with a round, the base
of that step's sampling round) and `request_seed` (one per task, rollout and turn, from such a base).
Does not own: where they are used (`rollout.stream` seeds a wave's requests, `trainer` the update), the RNG states a
checkpoint keeps (`runs.checkpoint`).

Published figures depend on these numbers, and a resumed run draws the same ones: the formulas never change.
"""

from __future__ import annotations

import hashlib


def step_seed(run_seed: int, step: int, batch: int | None = None) -> int:
    """The seed of training step `step` (0-based) of a run seeded `run_seed`: the policy update's; with
    `batch`, the base of that step's sampling round `batch` (0, then 1.. for the refills of dynamic sampling),
    from which `request_seed` derives each request's."""
    seed = run_seed * 1_000_003 + step
    return seed if batch is None else seed * 101 + batch


def request_seed(base: int, task_id: str, rollout_index: int, turn: int) -> int:
    """A stable 31-bit seed per (base, task, rollout, turn): Python's hash() is salted per process."""
    digest = hashlib.blake2b(f"{base}|{task_id}|{rollout_index}|{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF
