"""Every await on an environment has a deadline (`runner.bounded`, `asyncio.timeout` without a task per call):
a hanging `initial_messages`, `step`, `state_key` or `reward` ends only its own episode, as an infrastructure
error at `env_timeout_s`, while the others finish; a rollout cancelled from outside is cancelled, not turned
into timeouts; and one tool call (run without a task of its own) and several (gathered) give the same messages."""

from __future__ import annotations

import asyncio
import time

import pytest
from helpers import until

from agent_rl.core.types import Message, StopReason, ToolCall
from agent_rl.envs.base import Env, StepResult, ToolEnv
from agent_rl.rollout.engine import rollout_groups
from agent_rl.rollout.runner import EpisodeLimits, bounded


class HangingEnv(Env):
    """Task "hang-<method>" hangs in that method (`hanging` counts the episodes in it now); any other task plays
    one turn and ends."""

    hanging = 0

    def __init__(self, task):
        self.hang = task["id"].removeprefix("hang-") if task["id"].startswith("hang-") else ""

    async def _maybe_hang(self, method: str) -> None:
        if self.hang == method:
            HangingEnv.hanging += 1
            try:
                await asyncio.sleep(60)  # the hang: only a deadline or a cancellation ends it
            finally:
                HangingEnv.hanging -= 1

    async def initial_messages(self):
        await self._maybe_hang("initial_messages")
        return [Message("user", "hi")]

    async def state_key(self):
        await self._maybe_hang("state_key")
        return "s"

    async def step(self, reply, turn):
        await self._maybe_hang("step")
        return StepResult(done=True)

    async def reward(self, messages):
        await self._maybe_hang("reward")
        return 1.0


async def test_a_hanging_env_method_ends_its_episode_at_the_deadline_and_the_others_finish(scripted):
    sampler = scripted(lambda text: "ok")
    methods = ["initial_messages", "state_key", "step", "reward"]
    tasks = [{"id": f"hang-{m}"} for m in methods] + [{"id": "fine"}]
    t0 = time.monotonic()
    groups = await rollout_groups(tasks, HangingEnv, sampler, sampler.renderer,
                                  EpisodeLimits(max_turns=2, env_timeout_s=0.3), group_size=2, max_concurrent=10)
    assert time.monotonic() - t0 < 5  # the deadlines, not the 60 s hangs
    by_task = {g.task_id: g.trajectories for g in groups}
    for m in methods:
        assert [(t.stop_reason, t.error, t.reward) for t in by_task[f"hang-{m}"]] == \
            [(StopReason.ERROR, "TimeoutError", 0.0)] * 2, m
    assert [(t.stop_reason, t.error, t.reward) for t in by_task["fine"]] == [(StopReason.ENV_DONE, None, 1.0)] * 2
    assert [t.turns[0].state for t in by_task["fine"]] == ["s", "s"]  # the env's own state key


async def test_a_cancelled_rollout_is_cancelled_not_timed_out(scripted):
    sampler = scripted(lambda text: "ok")
    rollout = asyncio.create_task(rollout_groups([{"id": "hang-step"}], HangingEnv, sampler, sampler.renderer,
                                                 EpisodeLimits(max_turns=2, env_timeout_s=30), group_size=2))
    await until(lambda: HangingEnv.hanging == 2, "both episodes waiting in step")
    rollout.cancel()
    with pytest.raises(asyncio.CancelledError):
        await rollout
    assert HangingEnv.hanging == 0  # the cancellation reached both episodes' steps


async def test_bounded_returns_raises_and_times_out():
    async def value():
        return 7

    async def boom():
        raise ValueError("no")

    assert await bounded(value(), 1.0) == 7
    with pytest.raises(ValueError, match="no"):
        await bounded(boom(), 1.0)
    with pytest.raises(TimeoutError):
        await bounded(asyncio.sleep(5), 0.05)


def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: One.
        b: Two.
    """
    return a + b


class AddEnv(ToolEnv):
    async def initial_messages(self):
        return [Message("user", "add")]

    async def reward(self, messages):
        return 0.0


@pytest.mark.parametrize(("calls", "limit", "contents"), [
    (1, 8, ["1"]),
    (3, 8, ["1", "2", "3"]),
    (2, 1, ["1", "Error: call 2 not run: at most 1 tool calls per turn; make it in the next turn"]),
    (1, 0, ["Error: call 1 not run: at most 0 tool calls per turn; make it in the next turn"]),
])
async def test_one_call_and_several_give_one_message_each_in_order(calls, limit, contents):
    env = AddEnv([add], max_parallel_calls=limit)
    reply = Message("assistant", "", tool_calls=tuple(ToolCall("add", {"a": k, "b": 1}) for k in range(calls)))
    result = await env.step(reply, 0)
    assert [m.content for m in result.messages] == contents
    assert [r.ok for r in result.tool_calls] == [not c.startswith("Error") for c in contents]
