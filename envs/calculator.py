"""Calculator environment: arithmetic word problems, a calculator tool, reward for the right number.

Owns: the `CalculatorEnv` episode, its arithmetic tasks, scripted solver and audit target, and its spec
`ENV`. Does not own: the calculator tool (`tools.calculator`, re-exported here), where tasks come from
(any iterable of rows with `question` and `answer`), answer extraction and comparison (`rewards.answers`).
"""

from __future__ import annotations

from collections.abc import Sequence

from agent_rl.core.audit_target import ANSWERED, AuditTarget, Target, answer_choices
from agent_rl.core.env import Task
from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import Message, Reward, ToolCall, ToolCallRecord
from agent_rl.envs.base import ToolEnv, failed_calls, turn_rewards_on, with_turn_rewards
from agent_rl.rewards.answers import correct_answer, rational
from agent_rl.tools.calculator import calculator

__all__ = ["CalculatorEnv", "arithmetic_tasks", "calculator", "load_tasks", "make_env", "solve"]

SYSTEM = ("You are a careful assistant. Use the calculator tool for arithmetic, then give the final "
          "answer as a number.")


class CalculatorEnv(ToolEnv):
    """One arithmetic question; the episode ends when the model answers without a tool call. With turn
    rewards on (the task's `turn_rewards` column), a turn gets -0.1 per calculator call that failed."""

    def __init__(self, task: Task):
        super().__init__([calculator])
        for key in ("question", "answer"):
            if key not in task:
                raise ValueError(f"calculator task {task.get('id', '?')!r} has no {key!r} column")
        self.task = task
        self.turn_rewards = turn_rewards_on(task)

    def turn_reward(self, records: Sequence[ToolCallRecord]) -> Reward | None:
        return failed_calls(records) if self.turn_rewards else None

    async def initial_messages(self) -> list[Message]:
        return [Message("system", SYSTEM), Message("user", str(self.task["question"]))]

    async def reward(self, messages: Sequence[Message]) -> Reward:
        final = messages[-1].content if messages and messages[-1].role == "assistant" else ""
        # one final answer, compared by value; a reply listing several numbers gets no credit
        [correct] = await correct_answer([final], [self.task["answer"]])
        return Reward(correct, {"correct": correct})


def arithmetic_tasks(n: int, seed: int = 0) -> list[Task]:
    """Deterministic arithmetic questions (no dataset package needed), cycling through three levels:
    a one-step sum of small numbers, a one-step product, and a two-step `(a + b) * c`.

    The easy levels matter: a 135M model answers some of them right without tools, so GRPO groups
    have reward variance (signal) from the first step; the two-step level is where a calculator pays.
    """
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        level = i % 3
        if level == 0:
            a, b = rng.randint(1, 20), rng.randint(1, 20)
            expression, answer = f"{a} + {b}", a + b
        elif level == 1:
            a, b = rng.randint(2, 12), rng.randint(2, 12)
            expression, answer = f"{a} * {b}", a * b
        else:
            a, b, c = rng.randint(10, 999), rng.randint(10, 999), rng.randint(2, 19)
            expression, answer = f"({a} + {b}) * {c}", (a + b) * c
        rows.append({"id": f"arith-{seed}-{i}", "question": f"What is {expression}?", "answer": answer,
                     "expression": expression, "level": level})
    return rows


def solve(task: Task, messages: Sequence[Message], direct: bool = False) -> Message:
    """The demonstration: call the calculator on the task's expression, then state its result.
    With `direct`, state the answer at once (the share RL may learn to keep or drop)."""
    if direct:
        return Message("assistant", f"The answer is {task['answer']}.")
    results = [m.content for m in messages if m.role == "tool"]
    if not results:
        return Message("assistant", "", (ToolCall("calculator", {"expression": task["expression"]}),))
    return Message("assistant", f"The answer is {results[-1].strip()}.")


def make_env(task: Task) -> CalculatorEnv:
    return CalculatorEnv(task)


def load_tasks(n: int, seed: int = 0, split: str = "train", turn_rewards: bool = False) -> list[Task]:
    """`n` arithmetic questions; the eval split uses a disjoint seed stream. `turn_rewards`: each turn's
    failed calls cost it 0.1 (`CalculatorEnv`)."""
    return with_turn_rewards(arithmetic_tasks(n, seed=seed + (1_000_003 if split != "train" else 0)), turn_rewards)


def audit_target(task: Task, tasks: Sequence[Task]) -> Target:
    """The task as the reward audit's hacks see it: the calculator run on the question, the answer in
    a calculator call's arguments, the numbers next to it as wrong answers."""
    gold, question = str(task["answer"]), str(task["question"])
    return Target(task, question, gold, fmt="The answer is {}.",
                  probes=(ToolCall("calculator", {"expression": question}),),
                  carrier=ToolCall("calculator", {"expression": gold}),
                  **answer_choices(gold, [t["answer"] for t in tasks], value=rational(gold)))


# the answer and tool hacks, and those on its turn rewards (`rollout.env_args: {turn_rewards: true}`)
ENV = EnvSpec("calculator", make_env, load_tasks, solve=solve, audit=AuditTarget((*ANSWERED, "turn"), audit_target))
