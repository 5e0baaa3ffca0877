"""The calculator environment with an environment error injected in a share of its episodes (bench/faults.py).

Owns: `ENV`, the calculator's spec whose environments raise as they start (`initial_messages`) in a share
`AGENT_RL_FLAKY_SHARE` (default 0.05) of episodes, chosen by a hash of (`AGENT_RL_FLAKY_SEED`, task id, how many
environments of that task this process has made): the same tasks and seeds as `calculator`, so with
`rollout.on_error: retry` a run trains the batches an unfaulted run trains (a retry is another environment, which
fails with the same small chance).
Does not own: the calculator (envs/calculator.py), the retry (`rollout.stream`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections import Counter
from typing import Any

from agent_rl.core.registry import load_env

CALCULATOR = load_env("calculator")
SHARE = float(os.environ.get("AGENT_RL_FLAKY_SHARE", "0.05"))
SEED = os.environ.get("AGENT_RL_FLAKY_SEED", "0")
made: Counter[str] = Counter()  # environments made per task id, in this process


def flaky(task_id: str, n: int) -> bool:
    digest = hashlib.blake2b(f"{SEED}|{task_id}|{n}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") / 2**32 < SHARE


class FlakyStart:
    """An environment that raises as it starts, as one whose sandbox or service did not come up."""

    def __init__(self, env: Any):
        self.env = env

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)

    async def __aenter__(self) -> FlakyStart:
        await self.env.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.env.__aexit__(*exc)

    async def initial_messages(self) -> Any:
        raise RuntimeError("injected environment error (bench/flaky_env.py)")


def make_env(task: dict[str, Any]) -> Any:
    task_id = str(task.get("id", ""))
    made[task_id] += 1
    env = CALCULATOR.make_env(task)
    return FlakyStart(env) if flaky(task_id, made[task_id]) else env


ENV = dataclasses.replace(CALCULATOR, make_env=make_env)
