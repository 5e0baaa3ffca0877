"""Coding with visible tests: write a function, run its visible tests, read the failures, fix, submit;
the hidden tests grade it. A multi-turn environment for RL on HumanEval.

Owns: the task rows (HumanEval's problems with two or more tests, each `check` cut into visible and
hidden tests by `split_tests`; train and eval split by a hash of the task id, as `coding` splits them),
the `CodingTestsEnv` episode (its `run_tests` tool and reward), the scripted solver `solve`.
Does not own: running tests in the sandbox and explaining failures (`rewards.code.run_tests`), the
HumanEval rows and their split rule (`envs.coding`), sandboxing (`tools.sandbox`).

The task. The user message shows the function stub and its visible tests (assert statements, the
function called by its name). The one tool, `run_tests(code)`, runs the visible tests against the
agent's complete code in the sandbox and says per test whether it passed and, if not, what the call
returned or raised (or that the code did not load, or timed out). The episode ends at the first
reply without a tool call; that reply's last ```python block is the submission (`rewards.code`).

Visible and hidden. A problem's tests are the statements of its `check(candidate)` that call the
candidate (`rewards.code.split_check`): the first third of them (at least one, at most three) are
visible, the rest hidden, so they are disjoint: code that special-cases the visible tests' inputs
earns nothing. Setup statements (imports, a seeded rng) go with both. The 4 problems whose check is a
single statement (a loop over random inputs) are left out: nothing would stay hidden.

Reward: 0.5 x solved (every hidden test passes) + 0.5 x the share of hidden tests that pass, each in
a fresh sandbox, the submission in a process of its own (`rewards.code.run_hidden_tests`): all pass
is what pass@1 counts, the share gives a gradient to partly right code. No format part: any part a
submission can earn without passing a hidden test would pay the reward audit's hacks (a program that
only exits 0 compiles). Metrics (weight 0): `tests_passed`, `submitted`, `compiled`, `ran_tests` (the
visible tests were run before the submission), `test_runs`, `revised_after_failure` (a test run that failed was
followed by other code: a later run's or the submission: the test-fix loop).
"""

from __future__ import annotations

import ast
import functools
import math
import random
from collections.abc import Sequence
from typing import Any

from agent_rl.core.audit_target import AuditTarget, Target
from agent_rl.core.env import Task
from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import Message, Reward, ToolCall
from agent_rl.envs.base import ToolEnv
from agent_rl.envs.coding import CODING_AUDIT, GRADER_LIMITS, STUB, check_row, humaneval_dataset, split_of
from agent_rl.rewards.code import CheckOutcome, extract_code, run_hidden_tests, run_tests, split_check
from agent_rl.tools.sandbox import get_backend

SYSTEM = (
    "You are an expert Python programmer. Write the function the user asks for, then check it with the "
    "run_tests tool: it runs the visible tests against your complete code and shows what each failing call "
    "returned. Fix your code and test again until the tests pass. Then reply without a tool call, with your "
    "complete solution (imports, helpers and the whole function) in one ```python code block: hidden tests, "
    "different from the visible ones, grade it."
)
MAX_VISIBLE = 3  # visible tests per problem: the first third of its tests, at least one
TOOL_TIMEOUTS = 1  # a visible test that times out ends the tool's run: the rest are not run


def split_tests(test_source: str) -> tuple[str, str, list[str]]:
    """(visible check source, hidden check source, the visible tests as the agent reads them).

    Raises ValueError when the check has fewer than two tests."""
    preamble, steps = split_check(test_source)
    tests = [i for i, s in enumerate(steps) if s.is_test]
    if len(tests) < 2:
        raise ValueError(f"check has {len(tests)} test statement(s): at least two are needed, one to show "
                         "and one to hide")
    shown = tests[:min(MAX_VISIBLE, math.ceil(len(tests) / 3))]

    def check(keep: Sequence[int]) -> str:
        body = "".join(f"    {line}\n" for i, s in enumerate(steps) if not s.is_test or i in keep
                       for line in s.source.splitlines())
        return f"{preamble}\n\ndef check(candidate):\n{body}"

    return check(shown), check([i for i in tests if i not in shown]), [steps[i].source for i in shown]


def named(source: str, entry_point: str) -> str:
    """A test statement with `candidate` written as the function's name, as the agent sees it."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "candidate":
            node.id = entry_point
    return ast.unparse(tree)


@functools.cache
def _rows() -> tuple[dict[str, Any], ...]:
    rows = []
    for row in humaneval_dataset():
        try:
            visible, hidden, shown = split_tests(row["test"])
        except ValueError:
            continue  # HumanEval/32, 34, 38, 50: one looped test each
        rows.append({**row, "visible_tests": visible, "hidden_tests": hidden,
                     "shown_tests": [named(s, row["entry_point"]) for s in shown]})
    return tuple(rows)


def load_tasks(n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
    """Up to `n` problems of `split` ("train": 134, "eval": 26) in an order shuffled by `seed`."""
    if split not in ("train", "eval"):
        raise ValueError(f"coding_tests split must be 'train' or 'eval', got {split!r}")
    rows = [dict(row) for row in _rows() if split_of(row["id"]) == split]
    random.Random(seed).shuffle(rows)
    return rows[:n]


def check_task(task: Any) -> dict[str, Any]:
    """The row if it is a usable task (a HumanEval row plus its visible and hidden checks), else ValueError."""
    where = repr(task.get("id", "?")) if isinstance(task, dict) else "?"
    check_row(task, where)
    for column in ("visible_tests", "hidden_tests"):
        try:
            split_check(task.get(column) or "")
        except ValueError as e:
            raise ValueError(f"coding_tests task {where}: column {column!r}: {e}") from None
    if not isinstance(task.get("shown_tests"), list) or not task["shown_tests"]:
        raise ValueError(f"coding_tests task {where}: column 'shown_tests' must be a non-empty list")
    return task


def report(outcomes: Sequence[CheckOutcome], shown: Sequence[str]) -> str:
    """What `run_tests` tells the agent: a count, then each test, with why it failed."""
    if outcomes and outcomes[0].source == "load":
        return f"Your code did not load: {outcomes[0].detail}. No test ran."
    passed = sum(o.status == "ok" for o in outcomes)
    lines = [f"{passed} of {len(shown)} visible tests passed."]
    for i, test in enumerate(shown):
        outcome = outcomes[i] if i < len(outcomes) else None
        if outcome is None:
            lines.append(f"NOT RUN: {test}")
        elif outcome.status == "ok":
            lines.append(f"passed: {test}")
        else:
            lines.append(f"FAILED: {test}\n  {outcome.detail}")
    return "\n".join(lines)


class CodingTestsEnv(ToolEnv):
    """One problem: `run_tests` as often as the turns allow, then a final reply with the code."""

    def __init__(self, task: dict[str, Any], sandbox: str | None = None, max_timeouts: int = 2):
        self.task = check_task(task)
        self._backend = get_backend(sandbox, GRADER_LIMITS)
        self.max_timeouts = max_timeouts
        self.test_runs = 0
        self.runs: list[tuple[str, bool]] = []  # each run's code, and whether every visible test passed
        super().__init__([self.run_tests])

    async def run_tests(self, code: str) -> str:
        """Run the visible tests against your code and report each test: passed, or what the call returned.

        Args:
            code: Your complete solution: imports, helpers and the whole function definition.
        """
        self.test_runs += 1
        t = self.task
        _, outcomes = await run_tests(self._backend, t["prompt"], code, t["entry_point"], t["visible_tests"],
                                      TOOL_TIMEOUTS, explain=True)
        self.runs.append((code, len(outcomes) == len(t["shown_tests"]) and all(o.status == "ok" for o in outcomes)))
        return report(outcomes, t["shown_tests"])

    async def initial_messages(self) -> list[Message]:
        tests = "\n".join(self.task["shown_tests"])
        return [Message("system", SYSTEM),
                Message("user", f"Complete this Python function:\n\n```python\n{self.task['prompt']}```\n\n"
                                f"Visible tests:\n\n```python\n{tests}\n```")]

    async def reward(self, messages: Sequence[Message]) -> Reward:
        final = messages[-1] if messages and messages[-1].role == "assistant" else None
        code = extract_code(final.content) if final is not None and not final.tool_calls else None
        ran = float(self.test_runs > 0)
        codes = [c.strip() for c, _ in self.runs] + ([code.strip()] if code is not None else [])
        revised = any(not ok and any(later != c.strip() for later in codes[i + 1:])
                      for i, (c, ok) in enumerate(self.runs))
        parts = {"solved": 0.0, "tests_passed": 0.0, "submitted": float(code is not None), "compiled": 0.0,
                 "ran_tests": ran, "test_runs": float(self.test_runs), "revised_after_failure": float(revised)}
        if code is None:
            return Reward(0.0, parts)
        t = self.task
        graded = await run_hidden_tests(self._backend, t["prompt"], code, t["entry_point"], t["hidden_tests"],
                                        self.max_timeouts)
        solved = float(graded.share == 1.0)
        parts.update(solved=solved, tests_passed=graded.share, compiled=float(graded.compiled))
        return Reward(0.5 * solved + 0.5 * graded.share, parts)


def make_env(task: dict[str, Any]) -> CodingTestsEnv:
    return CodingTestsEnv(task)


def solve(task: dict[str, Any], messages: Sequence[Message], direct: bool = False) -> Message:
    """The demonstration: run the visible tests on the canonical solution once, then submit it."""
    solution = task["prompt"] + task["canonical_solution"]
    if direct or any(m.role == "tool" for m in messages):
        return Message("assistant", f"The visible tests pass. Here is my solution.\n\n```python\n{solution}```")
    return Message("assistant", "Let me run the visible tests first.", (ToolCall("run_tests", {"code": solution}),))


def audit_target(task: Task, tasks: Sequence[Task]) -> Target:
    """The task as the reward audit's hacks see it: as `coding`'s, with the code carried by `run_tests`;
    the visible-test hacks (`audit.visible_tests`) read the row's `shown_tests`."""
    gold = task["prompt"] + task["canonical_solution"]
    return Target(task, task["prompt"], gold, wrong=(STUB.format(e=task["entry_point"]),),
                  fmt="```python\n{}\n```", carrier=ToolCall("run_tests", {"code": gold}))


ENV = EnvSpec("coding_tests", make_env, load_tasks, solve=solve,
              audit=AuditTarget((*CODING_AUDIT, "visible_tests"), audit_target))
