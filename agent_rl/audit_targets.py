"""Where each environment's right answer is and which hacks apply to it: the reward audit's profiles.

Owns: `Profile` (the hacks that apply to an environment and how to build each task's `Target`) and
`profile_for` (by the environment's module: one profile per built-in environment, and a generic one
for any environment whose rows carry an `answer` or `solution` column, as TRL datasets do).
Does not own: the hacks (`agent_rl.hacks`), playing them and judging rewards (`agent_rl.audit`).

Which hacks apply: the answer-format and tool hacks to every environment graded on a final answer
(calculator, math, search_qa, kg_qa, mcp_units, mcp_time, datasets); to coding those that make sense for code (an empty
reply, several code blocks, the prompt echoed, the code only in a tool call) and the coding hacks;
to the GUI environments the GUI hacks. `toy` rewards short replies, not an answer, and has no solver:
it is not audited.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import ToolCall
from agent_rl.hacks import (
    ANSWER_HACKS,
    CODING_HACKS,
    GUI_HACKS,
    RAISES,
    TOOL_HACKS,
    Hack,
    Target,
)
from agent_rl.rewards.answers import rational


@dataclass(frozen=True)
class Profile:
    hacks: tuple[Hack, ...]
    target: Callable[[dict[str, Any], Sequence[dict[str, Any]], EnvSpec], Target]


def _hacks(*names: str) -> tuple[Hack, ...]:
    catalogue = {h.name: h for h in (*ANSWER_HACKS, *TOOL_HACKS, *CODING_HACKS, *GUI_HACKS)}
    return tuple(catalogue[n] for n in names)


def _solver(spec: EnvSpec, task: dict[str, Any]) -> Callable[..., Any] | None:
    return None if spec.solve is None else (lambda messages: spec.solve(task, messages, False))


def _show(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else str(float(value))


def _answers(gold: str, tasks: Sequence[dict[str, Any]], column: str) -> dict[str, Any]:
    """wrong (neighbours of a number, else other tasks' answers), every (gold among them), numeric."""
    value = rational(gold)
    if value is not None:
        wrong = tuple(_show(value + d) for d in (1, -1, 2, 10))
        return {"wrong": wrong, "every": tuple(_show(value + d) for d in range(-5, 6)), "numeric": True}
    others = sorted({str(t[column]) for t in tasks if str(t.get(column)) != gold}) or ["0"]
    return {"wrong": tuple(others), "every": (gold, *others), "numeric": False}


def _calculator(task: dict[str, Any], tasks: Sequence[dict[str, Any]], spec: EnvSpec) -> Target:
    gold, question = str(task["answer"]), str(task["question"])
    return Target(task, question, gold, fmt="The answer is {}.", solve=_solver(spec, task),
                  probes=(ToolCall("calculator", {"expression": question}),),
                  carrier=ToolCall("calculator", {"expression": gold}), **_answers(gold, tasks, "answer"))


def _math(task: dict[str, Any], tasks: Sequence[dict[str, Any]], spec: EnvSpec) -> Target:
    gold, question = str(task["answer"]), str(task["prompt"][0]["content"])
    probes = (ToolCall("calculator", {"expression": question}), ToolCall("python", {"code": f"print({question!r})"}))
    return Target(task, question, gold, fmt="The answer is \\boxed{{{}}}.", solve=_solver(spec, task), probes=probes,
                  carrier=ToolCall("calculator", {"expression": gold}), **_answers(gold, tasks, "answer"))


def _country_answers(task: dict[str, Any]) -> dict[str, Any]:
    from agent_rl.envs.search_qa import candidate_names

    accepted = {task["answer"], *task.get("aliases", [])}
    others = sorted(candidate_names(task["answer_type"]) - accepted)
    wrong = random.Random(str(task["id"])).sample(others, min(3, len(others)))
    return {"gold": task["answer"], "wrong": tuple(wrong), "every": tuple(sorted({task["answer"], *others})),
            "fmt": "<answer>{}</answer>"}


def _search_qa(task: dict[str, Any], tasks: Sequence[dict[str, Any]], spec: EnvSpec) -> Target:
    article = task["facts"][-1][0]  # the article holding the fact asked for
    probes = (ToolCall("search", {"query": task["question"], "k": 5}), ToolCall("read_article", {"title": article}))
    return Target(task, task["question"], solve=_solver(spec, task), probes=probes,
                  carrier=ToolCall("search", {"query": task["answer"], "k": 5}), **_country_answers(task))


def _kg_qa(task: dict[str, Any], tasks: Sequence[dict[str, Any]], spec: EnvSpec) -> Target:
    from agent_rl.envs.search_qa import hop_path

    entity, relations = hop_path(task["facts"])
    probes = (ToolCall("search_entities", {"name": entity}), ToolCall("get_relations", {"entity": entity}),
              ToolCall("follow", {"entity": entity, "relation": relations[0]}))  # the first hop: not the answer
    return Target(task, task["question"], solve=_solver(spec, task), probes=probes,
                  carrier=ToolCall("search_entities", {"name": task["answer"]}), **_country_answers(task))


def _coding(task: dict[str, Any], tasks: Sequence[dict[str, Any]], spec: EnvSpec) -> Target:
    gold = task["prompt"] + task["canonical_solution"]
    return Target(task, task["prompt"], gold, wrong=(RAISES.replace("{e}", task["entry_point"]),),
                  fmt="```python\n{}\n```", solve=_solver(spec, task), carrier=ToolCall("python", {"code": gold}))


def _gui(task: dict[str, Any], tasks: Sequence[dict[str, Any]], spec: EnvSpec) -> Target:
    return Target(task, str(task["instruction"]), solve=_solver(spec, task))


def _generic(task: dict[str, Any], tasks: Sequence[dict[str, Any]], spec: EnvSpec) -> Target:
    column = next((c for c in ("answer", "solution") if c in task), None)
    if column is None:
        raise ValueError(f"environment {spec.name!r}: task {task.get('id', '?')!r} has no 'answer' or 'solution' "
                         f"column, so the audit does not know the right answer")
    prompt = task.get("prompt")
    question = prompt[-1].get("content", "") if isinstance(prompt, list) and prompt else str(task.get("question", ""))
    gold = str(task[column])
    return Target(task, str(question), gold, solve=_solver(spec, task), **_answers(gold, tasks, column))


def _mcp_units(task: dict[str, Any], tasks: Sequence[dict[str, Any]], spec: EnvSpec) -> Target:
    from agent_rl.envs.mcp_units import _units

    gold = _units().show(task["answer"])  # as the server writes numbers: plain, 6 significant digits
    probes = (ToolCall("list_units", {}),)  # what the server offers: no answer in it
    carrier = ToolCall("convert", {"value": task["answer"], "from_unit": task["to_unit"], "to_unit": task["to_unit"]})
    return Target(task, str(task["question"]), gold, fmt="The answer is {}.", solve=_solver(spec, task), probes=probes,
                  carrier=carrier, **_answers(gold, tasks, "answer"))


def _mcp_time(task: dict[str, Any], tasks: Sequence[dict[str, Any]], spec: EnvSpec) -> Target:
    gold = str(task["answer"])  # HH:MM
    hours, minutes = map(int, gold.split(":"))
    shifts = ((1, 0), (-1, 0), (0, 30), (12, 0))  # an hour off, half an hour off, AM/PM swapped
    wrong = tuple(f"{(hours + dh) % 24:02d}:{(minutes + dm) % 60:02d}" for dh, dm in shifts)
    question = ToolCall("convert_time", {"source_timezone": task["source"], "time": task["time"],
                                         "target_timezone": task["target"]})
    carrier = ToolCall("convert_time", {"source_timezone": task["target"], "time": gold,
                                        "target_timezone": task["target"]})
    return Target(task, str(task["question"]), gold, wrong=wrong, every=(gold, *wrong), fmt="It is {}.",
                  probes=(question,), carrier=carrier, solve=_solver(spec, task), numeric=True)


ANSWERED = tuple(h.name for h in (*ANSWER_HACKS, *TOOL_HACKS))
PROFILES = {
    "agent_rl.envs.calculator": Profile(_hacks(*ANSWERED), _calculator),
    "agent_rl.envs.math": Profile(_hacks(*ANSWERED), _math),
    "agent_rl.envs.search_qa": Profile(_hacks(*ANSWERED), _search_qa),
    "agent_rl.envs.kg_qa": Profile(_hacks(*ANSWERED), _kg_qa),
    "agent_rl.envs.coding": Profile(_hacks("empty_reply", "several_answers", "echo_question", "answer_in_tool_call",
                                  "unknown_tool_then_guess", *(h.name for h in CODING_HACKS)), _coding),
    "agent_rl.envs.gui": Profile(_hacks("empty_reply", "echo_question", *(h.name for h in GUI_HACKS)), _gui),
    "agent_rl.envs.mcp_units": Profile(_hacks(*ANSWERED), _mcp_units),
    "agent_rl.envs.mcp_time": Profile(_hacks(*ANSWERED), _mcp_time),
    "agent_rl.envs.gui_browser": Profile(_hacks("empty_reply", "echo_question", *(h.name for h in GUI_HACKS)), _gui),
}
GENERIC = Profile(_hacks(*(h.name for h in ANSWER_HACKS), "answer_in_tool_call", "unknown_tool_then_guess"), _generic)


def profile_for(spec: EnvSpec) -> Profile:
    """The built-in environment's profile (by the module of its `make_env`), else the generic one."""
    module = getattr(spec.make_env, "__module__", "")
    if module == "agent_rl.envs.toy":
        raise ValueError(f"environment {spec.name!r} rewards short replies, not an answer, and has no scripted "
                         "solver: there is no reward hack to audit")
    return PROFILES.get(module, GENERIC)
