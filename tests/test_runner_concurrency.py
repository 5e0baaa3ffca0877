"""rollout_groups under a concurrency cap: never more episodes alive than the cap, results in task
and rollout order, only the episodes in play exist as asyncio tasks (not one per queued episode),
and the garbage collector is held back while it runs (heap frozen, automatic collection off, a
collection when too much piles up) and only then, with the cycles episodes made collected at the end."""

from __future__ import annotations

import asyncio
import gc
import weakref

from agent_rl.core.types import Message
from agent_rl.envs.base import Env, StepResult
from agent_rl.rollout.engine import rollout_groups
from agent_rl.rollout.quiet_gc import ROLLOUT_GC, QuietGC
from agent_rl.rollout.runner import EpisodeLimits


class SlowEnv(Env):
    alive = peak = 0
    tasks_seen = 0
    frozen: set[tuple[bool, bool]] = set()

    def __init__(self, task):
        self.task = task

    async def __aenter__(self):
        SlowEnv.alive += 1
        SlowEnv.peak = max(SlowEnv.peak, SlowEnv.alive)
        SlowEnv.tasks_seen = max(SlowEnv.tasks_seen, len(asyncio.all_tasks()))
        SlowEnv.frozen.add((gc.get_freeze_count() > 0, gc.isenabled()))
        return self

    async def close(self):
        SlowEnv.alive -= 1

    async def initial_messages(self):
        return [Message("user", f"task {self.task['id']}")]

    async def step(self, reply, turn):
        await asyncio.sleep(0.002)
        return StepResult(done=True)

    async def reward(self, messages):
        return float(self.task["id"])


async def test_the_cap_holds_and_results_keep_their_order(scripted):
    sampler = scripted(lambda text: "ok")
    tasks = [{"id": str(i)} for i in range(50)]
    groups = await rollout_groups(tasks, SlowEnv, sampler, sampler.renderer, EpisodeLimits(max_turns=2),
                                  group_size=3, max_concurrent=7)
    assert SlowEnv.peak == 7 and SlowEnv.alive == 0
    # the workers, each perhaps inside a wait_for (a task of its own), this test; none per queued episode
    assert SlowEnv.tasks_seen <= 2 * 7 + 2
    assert [g.task_id for g in groups] == [str(i) for i in range(50)]
    assert all(len(g.trajectories) == 3 and {t.reward for t in g.trajectories} == {float(g.task_id)}
               for g in groups)
    assert len(sampler.calls) == 150
    # the heap from before frozen and automatic collection off while it ran, and not after
    assert SlowEnv.frozen == {(True, False)}
    assert gc.get_freeze_count() == 0 and gc.isenabled()


async def test_overlapping_rollouts_restore_the_gc_when_the_last_one_ends(scripted):
    sampler = scripted(lambda text: "ok")
    limits = EpisodeLimits(max_turns=2)
    short = rollout_groups([{"id": "1"}], SlowEnv, sampler, sampler.renderer, limits, 1)
    long = rollout_groups([{"id": str(i)} for i in range(20)], SlowEnv, sampler, sampler.renderer, limits, 1, 1)
    long_task = asyncio.create_task(long)
    await asyncio.sleep(0)  # the long one starts first and ends last
    await short
    assert gc.get_freeze_count() > 0 and not gc.isenabled()  # still held for the long one
    await long_task
    assert gc.get_freeze_count() == 0 and gc.isenabled()


async def test_a_callers_own_freeze_is_left_alone(scripted):
    sampler = scripted(lambda text: "ok")
    gc.freeze()
    try:
        await rollout_groups([{"id": "1"}], SlowEnv, sampler, sampler.renderer, EpisodeLimits(max_turns=2), 2)
        assert gc.get_freeze_count() > 0  # the runner did not unfreeze what it had not frozen
    finally:
        gc.unfreeze()


async def test_a_callers_disabled_gc_stays_disabled(scripted):
    sampler = scripted(lambda text: "ok")
    gc.disable()
    try:
        await rollout_groups([{"id": "1"}], SlowEnv, sampler, sampler.renderer, EpisodeLimits(max_turns=2), 2)
        assert not gc.isenabled()
    finally:
        gc.enable()


class CycleEnv(SlowEnv):
    """Each episode leaves a reference cycle behind (which only the cyclic collector frees) and, on
    entering, notes how many earlier episodes' cycles are still alive."""

    cycles: list[weakref.ref] = []
    alive_at_entry: list[int] = []

    async def __aenter__(self):
        CycleEnv.alive_at_entry.append(sum(r() is not None for r in CycleEnv.cycles))
        return self

    async def step(self, reply, turn):
        node = {"task": self.task["id"]}
        node["self"] = node
        CycleEnv.cycles.append(weakref.ref(_Box(node)))
        return StepResult(done=True)


class _Box:  # dicts cannot be weakly referenced; a box in the cycle can
    def __init__(self, node):
        node["box"], self.node = self, node


async def test_cycles_wait_for_the_end_unless_too_many_objects_pile_up(scripted, monkeypatch):
    sampler = scripted(lambda text: "ok")
    limits = EpisodeLimits(max_turns=2)
    tasks = [{"id": str(i)} for i in range(4)]
    CycleEnv.cycles, CycleEnv.alive_at_entry = [], []
    await rollout_groups(tasks, CycleEnv, sampler, sampler.renderer, limits, 1, max_concurrent=1)
    assert CycleEnv.alive_at_entry == [0, 1, 2, 3]  # no collection while episodes ran...
    assert all(r() is None for r in CycleEnv.cycles)  # ...and every cycle collected when the rollout ended

    monkeypatch.setattr(ROLLOUT_GC, "collect_above", 0)  # any pile-up: collect after every episode
    CycleEnv.cycles, CycleEnv.alive_at_entry = [], []
    await rollout_groups(tasks, CycleEnv, sampler, sampler.renderer, limits, 1, max_concurrent=1)
    assert CycleEnv.alive_at_entry == [0, 0, 0, 0]


def test_quiet_gc_nests_and_only_the_last_exit_collects_and_restores():
    """The policy object alone (a fresh one, not the process's): a cycle made under two nested `quiet()`s
    outlives the inner exit and is collected at the outer one; `collect_if_piling_up` collects only above
    its threshold."""
    policy = QuietGC(collect_above=10**9)
    with policy.quiet():
        with policy.quiet():
            assert policy.rollouts == 2 and not gc.isenabled() and gc.get_freeze_count() > 0
            cycle = weakref.ref(_Box({"self": None}))
        assert policy.rollouts == 1 and not gc.isenabled()
        policy.collect_if_piling_up()  # far below 10**9 objects: nothing collected
        assert cycle() is not None
        policy.collect_above = 0
        policy.collect_if_piling_up()
        assert cycle() is None
        late = weakref.ref(_Box({"self": None}))
        assert late() is not None
    assert policy.rollouts == 0 and late() is None  # the last exit collected it
    assert gc.isenabled() and gc.get_freeze_count() == 0
