"""`rollout.admission.Admission` alone: which slots open at which version, which a step may take. Cases worked
out by hand, then the invariant checked on random runs: every slot is trained exactly once, at a step no
more than k versions after the version it opened at, and a step never waits once every open slot has ended."""

from __future__ import annotations

import random

from agent_rl.rollout.admission import Admission


def test_staleness_0_opens_a_step_at_a_time_and_takes_it_whole():
    a = Admission(batch=2, staleness=0, steps=3)
    assert list(a.open_up_to(0)) == [0, 1] and list(a.open_up_to(0)) == []  # version 0: step 0's two slots
    assert a.choose(0, {0}) is None  # slot 1 is due at step 0 too: wait
    assert a.choose(0, {0, 1}) == [0, 1]
    a.take([0, 1])
    assert list(a.open_up_to(0)) == []  # trained, but version 1 is not served yet: nothing opens
    assert list(a.open_up_to(1)) == [2, 3] and (a.deadline(2), a.deadline(3)) == (1, 1)


def test_staleness_2_runs_ahead_and_waits_only_to_keep_deadlines():
    a = Admission(batch=1, staleness=2, steps=6)
    assert list(a.open_up_to(0)) == [0, 1, 2]  # (k + 1 + version) x B = 3 slots before any push
    assert [a.deadline(n) for n in (0, 1, 2)] == [2, 2, 2]  # opened at version 0: trained by step 2
    assert a.choose(0, {2}) == [2]  # the slot of step 2 ended first: step 0 trains it
    a.take([2])
    assert list(a.open_up_to(1)) == [3] and a.deadline(3) == 3
    # slots 0 and 1 are both due by step 2; step 1 training slot 3 would leave both for step 2 alone
    assert a.choose(1, {3}) is None
    assert a.choose(1, {0, 3}) == [0]
    a.take([0])
    assert list(a.open_up_to(2)) == [4]
    assert a.choose(2, {3, 4}) is None  # slot 1 is due now: wait for it, however many others ended
    assert a.choose(2, {1, 3, 4}) == [1]


def test_the_last_steps_open_no_slot_beyond_the_run():
    a = Admission(batch=2, staleness=4, steps=2)
    assert list(a.open_up_to(0)) == [0, 1, 2, 3]  # (4 + 1) x 2 = 10 allowed, the run has 2 x 2
    assert a.choose(0, {3, 2}) == [2, 3] and a.choose(0, {0, 1, 2, 3}) == [0, 1]  # oldest first


def test_a_checkpoint_restores_the_slots():
    a = Admission(batch=2, staleness=1, steps=5)
    a.open_up_to(0)
    a.take([1, 3])
    saved = a.to_json()
    assert saved == {"opened": 4, "open": [0, 2]}
    b = Admission.from_json(saved, batch=2, staleness=1, steps=5)
    assert (b.opened, b.open) == (4, {0, 2}) and list(b.open_up_to(1)) == [4, 5]


def simulate(batch: int, staleness: int, steps: int, rng: random.Random) -> list[tuple[int, int, int]]:
    """A run in which each slot's group ends after a random number of 'ticks' (some 10x longer); returns
    (slot, version it opened at, step that trained it) for every slot."""
    a = Admission(batch, staleness, steps)
    opened_at, left, trained = {}, {}, []
    for n in a.open_up_to(0):
        opened_at[n], left[n] = 0, rng.choice([1, 1, 2, 3, 30])
    for step in range(steps):
        while (chosen := a.choose(step, [n for n in a.open if left[n] <= 0])) is None:
            assert any(left[n] > 0 for n in a.open), "waits although every open slot has ended"
            for n in a.open:
                left[n] -= 1  # time passes: every open slot's group makes progress
        a.take(chosen)
        assert len(chosen) == batch
        trained += [(n, opened_at[n], step) for n in chosen]
        for n in a.open_up_to(step + 1):  # the push of version step + 1
            opened_at[n], left[n] = step + 1, rng.choice([1, 1, 2, 3, 30])
    return trained


def test_every_slot_is_trained_once_and_within_k_versions_on_random_runs():
    rng = random.Random(0)
    for _ in range(300):
        batch, staleness, steps = rng.randint(1, 4), rng.randint(0, 5), rng.randint(1, 12)
        trained = simulate(batch, staleness, steps, rng)
        assert sorted(n for n, _, _ in trained) == list(range(batch * steps))  # each slot once, none dropped
        assert all(0 <= step - version <= staleness for _, version, step in trained)
        if staleness == 0:  # the synchronous loop: slot n at step n // B, opened at that version
            assert all(step == version == n // batch for n, version, step in trained)
