"""`rollout.admission.Admission` alone: which slots open at which version, which a step may take. Cases worked
out by hand, then the invariant checked on random runs (SkyRL's rule and fewer slots ahead, some resumed from a
checkpoint's JSON with another number ahead): every slot is trained exactly once, at a step no more than k versions
after the version it opened at, at most B + A slots are open after a push, and a step never waits once every open
slot has ended."""

from __future__ import annotations

import json
import random

import pytest

from agent_rl.rollout.admission import Admission, StaleCheckpoint
from agent_rl.rollout.stream import resumable


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


def test_sample_ahead_opens_slots_later_and_keeps_k_versions_for_each():
    a = Admission(batch=2, staleness=2, steps=4, slots_ahead=2)  # sample_ahead 1 step at k = 2
    assert list(a.open_up_to(0)) == [0, 1, 2, 3]  # B + A = 4 (SkyRL's rule would open all 6 that k = 2 allows)
    assert [a.deadline(n) for n in range(4)] == [2, 2, 2, 2]
    assert a.choose(0, {3}) is None and a.choose(0, {1, 3}) == [1, 3]
    a.take([1, 3])
    assert list(a.open_up_to(1)) == [4, 5] and (a.deadline(4), a.deadline(5)) == (3, 3)  # opened at 1: due at 3
    assert a.choose(1, {4, 5}) == [4, 5]  # 0 and 2 (due at 2) still fit into step 2
    a.take([4, 5])
    assert list(a.open_up_to(2)) == [6, 7] and a.choose(2, {6, 7}) is None  # 0 and 2 are due now
    assert a.choose(2, {0, 2, 6, 7}) == [0, 2]
    skyrl = Admission(batch=2, staleness=2, steps=4)
    assert list(skyrl.open_up_to(0)) == [0, 1, 2, 3, 4, 5] and skyrl.deadline(4) == 2  # slot 4 two versions earlier


def test_sample_ahead_beyond_k_steps_is_refused():
    with pytest.raises(ValueError, match="slots_ahead: 0 .. k x B = 2, got 3"):
        Admission(batch=2, staleness=1, steps=3, slots_ahead=3)


def test_a_checkpoint_restores_the_slots_with_the_versions_they_opened_at():
    a = Admission(batch=2, staleness=1, steps=5)
    a.open_up_to(0)
    a.take([1, 3])
    saved = a.to_json()
    assert saved == {"opened": 4, "open": [[0, 0], [2, 0]]}
    b = Admission.from_json(saved, batch=2, staleness=1, steps=5, slots_ahead=0)  # resumed with sample_ahead 0
    assert (b.opened, b.open) == (4, {0: 0, 2: 0}) and b.deadline(2) == 1  # opened at 0: still due at 1
    assert list(b.open_up_to(1)) == [] and list(b.open_up_to(2)) == [4, 5]  # from now on B + 0 open


def test_a_checkpoint_from_before_0_1_is_refused_in_one_line():
    """Slots listed without their versions, or a stream state that is a bare task position: written before agent-rl
    0.1.0, refused with one line that says so and what to do (no silent guess at the versions)."""
    line = (r"^checkpoint from before agent-rl 0\.1\.0: its stream state lists open slots without the version each "
            r"opened at; resume it with the version that wrote it, or start the run afresh without --resume$")
    with pytest.raises(StaleCheckpoint, match=line):
        Admission.from_json({"opened": 4, "open": [0, 2]}, batch=2, staleness=1, steps=5)
    with pytest.raises(StaleCheckpoint, match=r"^checkpoint from before agent-rl 0\.1\.0: its stream state is a task "
                                             r"position, not the stream's open slots; "):
        resumable(12)
    state = {"position": 6, "opened": 4, "open": [[0, 0], [2, 0]], "groups": [[0, 0, 3]]}
    assert resumable(state) is state


def simulate(batch: int, staleness: int, steps: int, ahead: int, rng: random.Random,
             resume: tuple[int, int] | None = None) -> list[tuple[int, int, int]]:
    """A run in which each slot's group ends after a random number of 'ticks' (some 10x longer); returns
    (slot, version it opened at, step that trained it) for every slot. `resume` = (step, A'): before that step
    the slots go through a checkpoint's JSON and the run goes on with A' slots ahead."""
    a = Admission(batch, staleness, steps, ahead)
    opened_at, left, trained = {}, {}, []
    for n in a.open_up_to(0):
        opened_at[n], left[n] = 0, rng.choice([1, 1, 2, 3, 30])
    for step in range(steps):
        if resume is not None and step == resume[0]:
            a = Admission.from_json(json.loads(json.dumps(a.to_json())), batch, staleness, steps, resume[1])
        while (chosen := a.choose(step, [n for n in a.open if left[n] <= 0])) is None:
            assert any(left[n] > 0 for n in a.open), "waits although every open slot has ended"
            for n in a.open:
                left[n] -= 1  # time passes: every open slot's group makes progress
        a.take(chosen)
        assert len(chosen) == batch
        trained += [(n, opened_at[n], step) for n in chosen]
        for n in a.open_up_to(step + 1):  # the push of version step + 1
            opened_at[n], left[n] = step + 1, rng.choice([1, 1, 2, 3, 30])
        assert len(a.open) <= batch + max(ahead, a.ahead)  # no more than B + A slots open after a push (A before
        # a resume with fewer ahead: until the slots it opened are trained)
    return trained


def test_every_slot_is_trained_once_and_within_k_versions_on_random_runs():
    rng = random.Random(0)
    for _ in range(300):
        batch, staleness, steps = rng.randint(1, 4), rng.randint(0, 5), rng.randint(1, 12)
        ahead = rng.choice([staleness * batch, rng.randint(0, staleness * batch)])  # SkyRL's rule, or fewer
        resume = (rng.randint(0, steps - 1), rng.randint(0, staleness * batch)) if rng.random() < 0.3 else None
        trained = simulate(batch, staleness, steps, ahead, rng, resume)
        assert sorted(n for n, _, _ in trained) == list(range(batch * steps))  # each slot once, none dropped
        assert all(0 <= step - version <= staleness for _, version, step in trained)
        if resume is None:  # a slot opens as late as A allows (what keeps the lag low), no later
            assert all(version == max(0, (n - ahead) // batch) for n, version, _ in trained)
        if staleness == 0:  # the synchronous loop: slot n at step n // B, opened at that version
            assert all(step == version == n // batch for n, version, step in trained)
