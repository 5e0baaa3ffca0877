"""Math environment: GSM8K-style word problems and arithmetic, a calculator and a sandboxed Python.

Owns: the task rows (reasoning-gym's `gsm_symbolic` and `basic_arithmetic`, interleaved, as a
`datasets.Dataset` in TRL's conversational format; train and eval split by a hash of the question,
so they never share one), the rubric (the right final answer, checked by math-verify, is the whole
reward; format checks and tool use are weight-0 metrics), `MathEnv` (a `RubricEnv` with the
calculator and a persistent sandboxed `python` interpreter it opens and closes), the scripted
solver `solve`, the audit target and the spec `ENV`.
Does not own: answer extraction and equivalence (`rewards.answers`), format checks
(`rewards.format`), the sandbox (`tools.sandbox`), playing dataset rows (`envs.dataset`).

The model may answer directly; tools are there when it wants them.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from typing import Any

import datasets

from agent_rl.core.audit_target import ANSWERED, AuditTarget, Target, answer_choices
from agent_rl.core.env import Task
from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import Message, ToolCall
from agent_rl.envs.calculator import calculator
from agent_rl.envs.dataset import RubricEnv, row_to_task, tasks_from_dataset
from agent_rl.rewards.answers import correct_answer, rational
from agent_rl.rewards.format import no_tool_markup, single_answer, tags_closed, used_tools
from agent_rl.rewards.rubric import Rubric
from agent_rl.tools.base import ToolError
from agent_rl.tools.python_tool import PythonSessionTool
from agent_rl.tools.sandbox import Backend

SYSTEM = ("You are a careful math assistant. Solve the problem. You may use the calculator or the python "
          "tool for arithmetic, or answer directly. End your final reply with the answer in \\boxed{}, "
          "e.g. \\boxed{42}.")
RUBRIC = Rubric([(correct_answer, 1.0), (single_answer, 0.0), (no_tool_markup, 0.0), (tags_closed, 0.0),
                 (used_tools, 0.0)])
# reasoning-gym datasets and their settings: arithmetic of 2-4 terms up to 3 digits (a calculator pays)
SOURCES = {"gsm_symbolic": {}, "basic_arithmetic": {"min_terms": 2, "max_terms": 4, "max_digits": 3}}
EVAL_SHARE = 0.1  # of all questions, by hash: the eval split


def _reasoning_gym() -> Any:
    """Import reasoning-gym (slow: it loads all its datasets) with the Hub offline, and only
    for the import: HF_HUB_OFFLINE must not leak into processes started later (a vLLM server)."""
    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import reasoning_gym
    finally:
        if before is None:
            del os.environ["HF_HUB_OFFLINE"]
        else:
            os.environ["HF_HUB_OFFLINE"] = before
    return reasoning_gym


def in_eval_split(question: str) -> bool:
    digest = hashlib.blake2b(question.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < EVAL_SHARE * 2**64


_TERM = re.compile(r"\d+(?:\.\d+)?|[-+*/×÷]|\bx\b")


def final_step(solution: str, answer: str) -> str:
    """The arithmetic of a worked solution's step that computes the answer ("160 + 128" from
    "Combined total: 160 + 128 = 288"), checked with the calculator; "" when none does."""
    for line in reversed(solution.splitlines()):
        sides = line.replace(",", "").split("=")
        for left in reversed(sides[:-1]):
            terms: list[str] = []  # the longest tail of `left` that reads number (op number)*
            for tok in reversed(_TERM.findall(left)):
                if tok[0].isdigit() != (len(terms) % 2 == 0):  # numbers at even places from the end
                    break
                terms.insert(0, {"×": "*", "x": "*", "÷": "/"}.get(tok, tok))
            if terms and not terms[0][0].isdigit():
                terms.pop(0)
            if len(terms) < 3:
                continue
            expression = " ".join(terms)
            try:
                if abs(float(calculator(expression)) - float(answer)) < 1e-9 * max(1.0, abs(float(answer))):
                    return expression
            except (ToolError, ValueError):
                continue
    return ""


def _row(source: str, seed: int, index: int, item: dict[str, Any]) -> Task:
    meta = item["metadata"]
    if source == "basic_arithmetic":
        expression = meta["expression"]
    else:
        expression = final_step(meta.get("answer_cot", ""), item["answer"])
    return {"id": f"{source}-{seed}-{index}", "prompt": [{"role": "user", "content": item["question"]}],
            "answer": str(item["answer"]), "source": source, "expression": expression}


def math_dataset(n: int, seed: int = 0, split: str = "train") -> datasets.Dataset:
    """`n` problems alternating between the sources, deterministic per seed, disjoint across splits.

    Columns: id, prompt (one user message), answer (a string), source, expression (arithmetic that
    computes the answer, for the scripted solver; "" when the worked solution gives none).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"unknown split {split!r}; use 'train' or 'eval'")
    rg = _reasoning_gym()
    per_source = -(-n // len(SOURCES))
    streams = [_rows_of(rg, name, per_source, seed, split == "eval") for name in SOURCES]
    rows = [row for group in zip(*streams) for row in group][:n]
    return datasets.Dataset.from_list(rows)


def _rows_of(rg: Any, source: str, n: int, seed: int, eval_split: bool) -> list[Task]:
    """The first `n` rows of one source that belong to the split, in index order, no question twice.
    (Item i of a reasoning-gym dataset depends only on its seed and i, not on the dataset size.)"""
    size = 100 * n + 1000  # the eval split keeps ~1 in 10
    generator = rg.create_dataset(source, seed=seed, size=size, **SOURCES[source])
    rows: list[Task] = []
    seen: set[str] = set()
    for index in range(size):
        if len(rows) == n:
            break
        item = generator[index]
        if in_eval_split(item["question"]) == eval_split and item["question"] not in seen:
            seen.add(item["question"])
            rows.append(_row(source, seed, index, item))
    if len(rows) < n:
        raise ValueError(f"{source}: only {len(rows)} distinct questions of {n} found in {size} items")
    return rows


class MathEnv(RubricEnv):
    """One problem; tools: `calculator` and `python` (a sandboxed interpreter owned by the episode)."""

    def __init__(self, task: Task, sandbox: Backend | None = None):
        task = row_to_task(task, required=("answer",))  # a bad row fails before a sandbox is sought
        self._python = PythonSessionTool(sandbox)
        super().__init__(task, [calculator, self._python.python], RUBRIC, SYSTEM, required=("answer",))

    async def __aenter__(self) -> MathEnv:
        await self._python.__aenter__()
        return self

    async def close(self) -> None:
        await self._python.__aexit__(None, None, None)


def make_env(task: Task) -> MathEnv:
    return MathEnv(task)


def load_tasks(n: int, seed: int = 0, split: str = "train") -> list[Task]:
    return tasks_from_dataset(math_dataset(n, seed, split), required=("answer",))


def solve(task: Task, messages: Sequence[Message], direct: bool = False) -> Message:
    """The demonstration: compute the task's expression with the calculator, then give the answer
    boxed. Directly (or when the task has no expression), give the answer at once."""
    final = Message("assistant", f"The answer is \\boxed{{{task['answer']}}}.")
    if direct or not task.get("expression") or any(m.role == "tool" for m in messages):
        return final
    return Message("assistant", "", (ToolCall("calculator", {"expression": task["expression"]}),))


def audit_target(task: Task, tasks: Sequence[Task]) -> Target:
    """The task as the reward audit's hacks see it: the calculator or python run on the question, the
    answer in a calculator call's arguments, numbers next to it (or the other answers) as wrong ones."""
    gold, question = str(task["answer"]), str(task["prompt"][0]["content"])
    probes = (ToolCall("calculator", {"expression": question}), ToolCall("python", {"code": f"print({question!r})"}))
    return Target(task, question, gold, fmt="The answer is \\boxed{{{}}}.", probes=probes,
                  carrier=ToolCall("calculator", {"expression": gold}),
                  **answer_choices(gold, [t["answer"] for t in tasks], value=rational(gold)))


ENV = EnvSpec("math", make_env, load_tasks, solve=solve, audit=AuditTarget(ANSWERED, audit_target))
