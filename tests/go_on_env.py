"""A test environment of three turns whatever the model says (the tiny random model calls no tool): after each
reply the user says "Go on.", and the third reply ends the episode; the reward is the toy's dense brevity reward on
all three replies. `rollout.env: go_on_env` (tests/ is on the import path under pytest)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import Message, Reward
from agent_rl.envs.base import StepResult
from agent_rl.envs.toy import BrevityEnv, load_tasks

TURNS = 3


class GoOnEnv(BrevityEnv):
    async def step(self, reply: Message, turn: int) -> StepResult:
        if turn + 1 >= TURNS:
            return StepResult(done=True)
        return StepResult(messages=(Message("user", "Go on."),))

    async def reward(self, messages: Sequence[Message]) -> Reward:
        chars = sum(len(m.content) for m in messages if m.role == "assistant")
        return Reward(max(0.0, 1.0 - chars / (TURNS * self.budget_chars)), {"chars": float(chars)})


def make_env(task: dict[str, Any]) -> GoOnEnv:
    return GoOnEnv(task)


ENV = EnvSpec("go_on_env", make_env, load_tasks)
