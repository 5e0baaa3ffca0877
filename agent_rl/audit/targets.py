"""Which hacks the audit plays on an environment, and on which targets: what its spec says, or the generic.

Owns: `Plan` (the hacks that apply and each task's `Target`, the solver bound to it) and `plan_for`:
the environment's own audit target (`EnvSpec.audit`, filled in by each built-in environment), a
refusal where the spec says there is nothing to audit (`toy`: it rewards short replies, not an
answer), else the generic target of any environment whose rows carry an `answer` or `solution`
column, as TRL datasets do (`generic_target`, with the answer-format hacks and two tool hacks).
Does not own: the hacks (`audit.hacks`), what a target holds (`core.audit_target`), where each
built-in environment's right answer is (its module), playing and judging (`audit.play`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agent_rl.audit.catalogue import hacks_named
from agent_rl.audit.hacks import Hack
from agent_rl.core.audit_target import NotAudited, Target, answer_choices
from agent_rl.core.env import Task
from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import Message
from agent_rl.rewards.answers import rational

# what an environment with no audit target of its own gets: every answer-format hack and the tool hacks
# that need no tool of its own
GENERIC_HACKS = ("answer", "answer_in_tool_call", "unknown_tool_then_guess")
Build = Callable[[Task, Sequence[Task]], Target]  # (task, every task of the sample) -> the task as a hack sees it


@dataclass(frozen=True)
class Plan:
    hacks: tuple[Hack, ...]
    target: Build  # with the spec's solver bound to each task


def plan_for(spec: EnvSpec) -> Plan:
    """The hacks and targets of `spec`: its audit target, else the generic one; a ValueError of one line
    for an environment that has nothing to audit or names a hack the catalogue lacks."""
    audit = spec.audit
    if isinstance(audit, NotAudited):
        raise ValueError(f"environment {spec.name!r} {audit.why}: there is no reward hack to audit")
    if audit is None:
        generic = functools.partial(generic_target, spec=spec)
        return Plan(hacks_named(GENERIC_HACKS, spec.name), _with_solver(spec, generic))
    return Plan(hacks_named(audit.hacks, spec.name), _with_solver(spec, audit.target))


def _with_solver(spec: EnvSpec, build: Build) -> Build:
    """`build`, its targets given the spec's solver bound to their task (None without one)."""
    solve = spec.solve
    if solve is None:
        return build

    def bound(task: Task, tasks: Sequence[Task]) -> Target:
        def reply(messages: Sequence[Message]) -> Message:
            return solve(task, messages, False)
        return dataclasses.replace(build(task, tasks), solve=reply)

    return bound


def generic_target(task: Task, tasks: Sequence[Task], spec: EnvSpec) -> Target:
    """A row with an `answer` (or `solution`) column: that is the right answer; the question is the
    prompt's last message, or the `question` column."""
    column = next((c for c in ("answer", "solution") if c in task), None)
    if column is None:
        raise ValueError(f"environment {spec.name!r}: task {task.get('id', '?')!r} has no 'answer' or 'solution' "
                         f"column, so the audit does not know the right answer")
    prompt = task.get("prompt")
    question = prompt[-1].get("content", "") if isinstance(prompt, list) and prompt else str(task.get("question", ""))
    gold = str(task[column])
    return Target(task, str(question), gold, **answer_choices(gold, [t[column] for t in tasks], value=rational(gold)))
