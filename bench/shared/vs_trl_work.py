"""The work both sides of bench/vs_trl.py run, the same Python under both trainers: its task rows, its reward and
its tool, and agent-rl's environment of it.

Owns: the task rows in TRL's conversational format (`bench_rows`), the TRL reward function `correct`, and `ENV`
(`make_env`, `load_tasks`: agent-rl's side is `rollout.env=bench.shared.vs_trl_work`).
Does not own: the calculator tool (`envs.calculator`, re-exported here), the settings (examples/calculator_recipe.yaml,
read by bench/vs_trl.py), either trainer's set-up (bench/vs_trl.py, bench/trl_side.py).

TRL's side imports this module in TRL's own virtualenv: what it imports on import must be in that venv's
requirements (bench/vs_trl.py's `TRL_REQUIREMENTS`; tests/test_bench_runs.py checks), so the rest is imported
inside `make_env`, which only agent-rl's side calls.
"""

from __future__ import annotations

import re
from typing import Any

from agent_rl.core.registry import EnvSpec
from agent_rl.envs.calculator import SYSTEM, arithmetic_tasks, calculator

__all__ = ["ENV", "bench_rows", "calculator", "correct", "load_tasks", "make_env"]


def bench_rows(n: int) -> list[dict[str, Any]]:
    """The first `n` task rows in TRL's conversational format (deterministic: a prefix never changes)."""
    return [{"id": t["id"], "answer": t["answer"],
             "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": t["question"]}]}
            for t in arithmetic_tasks(n, seed=0)]


_TOOL_CALL = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def correct(prompts, completions, answer, **kwargs) -> list[float]:
    """TRL reward function: 1.0 when the last number of the final assistant reply is the answer.

    `completions` are lists of message dicts (the assistant's turns and tool messages); a completion
    that ends on a tool message or on a tool call has no final reply and earns 0.
    """
    rewards = []
    for completion, expected in zip(completions, answer):
        last = completion[-1] if completion else {}
        text = str(last.get("content") or "") if last.get("role") == "assistant" and not last.get("tool_calls") else ""
        numbers = _NUMBER.findall(_TOOL_CALL.sub("", text))
        try:
            rewards.append(float(bool(numbers) and float(numbers[-1].replace(",", "")) == float(expected)))
        except ValueError:
            rewards.append(0.0)
    return rewards


def make_env(task: dict[str, Any]):
    """agent-rl's environment of the work: the row's prompt, the calculator, the reward `correct`."""
    from agent_rl.envs.dataset import RubricEnv
    from agent_rl.rewards.rubric import Rubric

    return RubricEnv(task, [calculator], Rubric([(correct, 1.0)]), required=("answer",))


def load_tasks(n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
    return bench_rows(n)  # one fixed row order for both trainers, whatever the run's seed


ENV = EnvSpec("vs_trl", make_env, load_tasks)
