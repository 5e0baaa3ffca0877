"""A test environment of three turns whatever the model says (the tiny random model calls no tool): after each
reply the user says "Go on.", and the third reply ends the episode; the reward is the toy's dense brevity reward on
all three replies. `rollout.env: go_on_env` (tests/ is on the import path under pytest).

A test that needs episodes to span a weight push sets `GATE` to a `PushGate` and opens it at the push."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import Message, Reward
from agent_rl.envs.base import StepResult
from agent_rl.envs.toy import BrevityEnv, load_tasks

TURNS = 3


class PushGate:
    """Episodes of every task but the first `free` to play wait after their first reply until `opened` is set (at
    the first push), so their later turns are sampled by a newer version whatever the machine's speed. The free tasks'
    groups make the first step; a wait ends after `timeout_s` in any case, so a test fails rather than hangs."""

    def __init__(self, free: int, timeout_s: float = 120.0):
        self.free, self.timeout_s, self.tasks, self.opened = free, timeout_s, set[str](), asyncio.Event()

    async def hold(self, task_id: str) -> None:
        if len(self.tasks) < self.free:
            self.tasks.add(task_id)
        if task_id not in self.tasks:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.opened.wait(), self.timeout_s)


GATE: PushGate | None = None


class GoOnEnv(BrevityEnv):
    async def step(self, reply: Message, turn: int) -> StepResult:
        if turn == 0 and GATE is not None:
            await GATE.hold(self.task["id"])
        if turn + 1 >= TURNS:
            return StepResult(done=True)
        return StepResult(messages=(Message("user", "Go on."),))

    async def reward(self, messages: Sequence[Message]) -> Reward:
        chars = sum(len(m.content) for m in messages if m.role == "assistant")
        return Reward(max(0.0, 1.0 - chars / (TURNS * self.budget_chars)), {"chars": float(chars)})


def make_env(task: dict[str, Any]) -> GoOnEnv:
    return GoOnEnv(task)


ENV = EnvSpec("go_on_env", make_env, load_tasks)
