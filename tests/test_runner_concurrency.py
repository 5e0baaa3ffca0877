"""rollout_groups under a concurrency cap: never more episodes alive than the cap, results in task
and rollout order, only the episodes in play exist as asyncio tasks (not one per queued episode),
and the garbage collector is held back (heap frozen, young collections rarer) while it runs, and
only then."""

from __future__ import annotations

import asyncio
import gc

from agent_rl.core.types import Message
from agent_rl.rollout.runner import EpisodeLimits, rollout_groups
from envs.base import Env, StepResult


class SlowEnv(Env):
    alive = peak = 0
    tasks_seen = 0
    frozen: set[tuple[bool, int]] = set()

    def __init__(self, task):
        self.task = task

    async def __aenter__(self):
        SlowEnv.alive += 1
        SlowEnv.peak = max(SlowEnv.peak, SlowEnv.alive)
        SlowEnv.tasks_seen = max(SlowEnv.tasks_seen, len(asyncio.all_tasks()))
        SlowEnv.frozen.add((gc.get_freeze_count() > 0, gc.get_threshold()[0]))
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
    thresholds = gc.get_threshold()
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
    # the heap from before frozen and young collections rarer while it ran, and not after
    assert SlowEnv.frozen == {(True, 50_000)}
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds


async def test_overlapping_rollouts_restore_the_gc_when_the_last_one_ends(scripted):
    sampler = scripted(lambda text: "ok")
    thresholds = gc.get_threshold()
    limits = EpisodeLimits(max_turns=2)
    short = rollout_groups([{"id": "1"}], SlowEnv, sampler, sampler.renderer, limits, 1)
    long = rollout_groups([{"id": str(i)} for i in range(20)], SlowEnv, sampler, sampler.renderer, limits, 1, 1)
    long_task = asyncio.create_task(long)
    await asyncio.sleep(0)  # the long one starts first and ends last
    await short
    assert gc.get_freeze_count() > 0 and gc.get_threshold()[0] == 50_000  # still held for the long one
    await long_task
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds


async def test_a_callers_own_freeze_is_left_alone(scripted):
    sampler = scripted(lambda text: "ok")
    gc.freeze()
    try:
        await rollout_groups([{"id": "1"}], SlowEnv, sampler, sampler.renderer, EpisodeLimits(max_turns=2), 2)
        assert gc.get_freeze_count() > 0  # the runner did not unfreeze what it had not frozen
    finally:
        gc.unfreeze()
