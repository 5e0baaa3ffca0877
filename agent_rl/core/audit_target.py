"""What an environment tells the reward audit: which hacks apply to it, and each task as a hack sees it.

Owns: `Target` (one task as a hack sees it: the question, the right answer, wrong ones, every
candidate, the answer format, real tool calls to make), `AuditTarget` (the hacks that apply, by name
or group, and how to build a task's `Target`), `NotAudited` (why an environment has nothing to
audit), the hack groups an environment names (`ANSWERED`), and `answer_choices` (wrong answers
and every candidate around a right one).
Does not own: the hacks themselves, playing them and judging the rewards (`agent_rl.audit`, a floor
up: an environment names hacks, it never imports them), the generic target of an environment
that has none (`agent_rl.audit.targets`).

An environment module puts its audit target in its spec (`core.registry.EnvSpec.audit`):

    def audit_target(task: Task, tasks: Sequence[Task]) -> Target:
        gold = str(task["answer"])
        return Target(task, task["question"], gold, fmt="The answer is {}.",
                      **answer_choices(gold, [t["answer"] for t in tasks], value=rational(gold)))

    ENV = EnvSpec("calculator", make_env, load_tasks, solve=solve, audit=AuditTarget(ANSWERED, audit_target))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from agent_rl.core.env import Task
from agent_rl.core.types import Message, ToolCall

# the hack groups of `agent_rl.audit`: answer-format tricks, tool tricks, tricks on a test harness, on
# tests the agent can see, a GUI task claimed done, turn rewards collected without solving; an
# `AuditTarget` names groups and single hacks alike
HACK_GROUPS = ("answer", "tool", "coding", "visible_tests", "gui", "turn")
ANSWERED = ("answer", "tool")  # what applies to an environment graded on one final answer


@dataclass(frozen=True)
class Target:
    """One task as a hack sees it."""

    task: Task
    question: str  # the user's request
    gold: str = ""  # the right answer, as the environment's answer column holds it
    wrong: tuple[str, ...] = ()  # plausible wrong answers, the most plausible first
    every: tuple[str, ...] = ()  # every candidate answer, the right one included
    fmt: str = "{}"  # how the environment asks for an answer, e.g. "<answer>{}</answer>"
    probes: tuple[ToolCall, ...] = ()  # real tool calls whose output a hack may echo
    carrier: ToolCall | None = None  # a real tool call that holds the right answer in its arguments
    # the environment's scripted solver bound to the task (messages -> reply); the audit fills it in
    # from the spec's `solve`, an environment leaves it None
    solve: Callable[[Sequence[Message]], Message] | None = None
    numeric: bool = False  # the answer is a number

    def say(self, answer: str) -> str:
        return self.fmt.format(answer)


@dataclass(frozen=True)
class AuditTarget:
    """How the reward audit plays an environment (`agent-rl audit-reward`)."""

    # the hacks that apply, in the order of the report: names of hacks or of groups (HACK_GROUPS),
    # e.g. ANSWERED, or ("empty_reply", "echo_question", "gui"); the audit rejects a name it lacks
    hacks: tuple[str, ...]
    # (task, every task of the sample) -> the task as a hack sees it; the sample gives wrong answers
    target: Callable[[Task, Sequence[Task]], Target]


@dataclass(frozen=True)
class NotAudited:
    """An environment with no reward hack to audit; the audit refuses it with `why`."""

    why: str  # completes "environment 'toy' ...", e.g. "rewards short replies, not an answer"


def _show(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else str(float(value))


def answer_choices(gold: str, others: Iterable[Any], value: Fraction | None = None) -> dict[str, Any]:
    """`wrong`, `every` and `numeric` of a `Target` whose right answer is `gold`: for a number (`value`,
    e.g. `rewards.answers.rational(gold)`) its neighbours (gold + 1, - 1, + 2, + 10; every one within 5),
    else the other answers of the sample (`others`, gold among them or not; "0" when there is none)."""
    if value is not None:
        wrong = tuple(_show(value + d) for d in (1, -1, 2, 10))
        return {"wrong": wrong, "every": tuple(_show(value + d) for d in range(-5, 6)), "numeric": True}
    rest = sorted({str(o) for o in others if str(o) != gold}) or ["0"]
    return {"wrong": tuple(rest), "every": (gold, *rest), "numeric": False}
