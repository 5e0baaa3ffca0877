"""A test environment whose groups are half without signal: tasks with an even number always earn
1.0 (dynamic sampling must resample them, taking extra tasks), odd ones earn the toy's dense brevity
reward. `rollout.env: half_flat_env` (tests/ is on the import path under pytest)."""

from __future__ import annotations

from typing import Any

from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import Reward
from agent_rl.envs.toy import BrevityEnv


class HalfFlatEnv(BrevityEnv):
    async def reward(self, messages):
        if self.task["number"] % 2 == 0:
            return Reward(1.0)
        return await super().reward(messages)


def make_env(task: dict[str, Any]) -> HalfFlatEnv:
    return HalfFlatEnv(task)


def load_tasks(n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
    return [{"id": f"half-{seed}-{i}", "number": i, "topic": "numbers"} for i in range(n)]


ENV = EnvSpec("half_flat_env", make_env, load_tasks)
