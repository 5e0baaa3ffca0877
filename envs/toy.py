"""Toy environment with a dense reward, for learning tests and for seeing GRPO move quickly.

Owns: `BrevityEnv`: a one-turn episode rewarded by how much of its character budget the answer
leaves unused (1 - characters / budget). Every rollout gets a different reward, so no group lacks
signal, and even a tiny random model can learn it (end the turn sooner). Negating the advantages
must make answers longer: the learning test checks both directions.
Its spec `ENV` refuses the reward audit: the reward is for short replies, not for an answer.
Does not own: anything a real agent needs; use envs.calculator and friends for that.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent_rl.core.audit_target import NotAudited
from agent_rl.core.env import Task
from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import Message, Reward
from agent_rl.envs.base import Env, StepResult


class BrevityEnv(Env):
    def __init__(self, task: Task, budget_chars: int = 200):
        self.task, self.budget_chars = task, budget_chars

    async def initial_messages(self) -> list[Message]:
        return [Message("user", f"Say something about {self.task['topic']}.")]

    async def step(self, reply: Message, turn: int) -> StepResult:
        return StepResult(done=True)

    async def reward(self, messages: Sequence[Message]) -> Reward:
        chars = len(messages[-1].content) if messages[-1].role == "assistant" else self.budget_chars
        return Reward(max(0.0, 1.0 - chars / self.budget_chars), {"chars": float(chars)})


def make_env(task: Task) -> BrevityEnv:
    return BrevityEnv(task)


def load_tasks(n: int, seed: int = 0, split: str = "train") -> list[Task]:
    topics = ["cats", "rivers", "numbers", "music", "trees", "stars", "bread", "trains"]
    return [{"id": f"toy-{split}-{seed}-{i}", "topic": topics[(i + seed) % len(topics)]} for i in range(n)]


ENV = EnvSpec("toy", make_env, load_tasks,
              audit=NotAudited("rewards short replies, not an answer, and has no scripted solver"))
