"""Unit conversion with the tools of a real MCP server: the example `MCPEnv`.

Owns: `UnitsEnv` (one conversion question; the tools `convert` and `list_units` come from the MCP
server examples/mcp_units_server.py, started over stdio, or reached over HTTP at a task's
`mcp_url`), the questions (`unit_tasks`), the scripted solver `solve`, the audit target and the spec
`ENV`; `units_module` (the server's file, loaded for its unit table, conversions and number format).
Does not own: the unit table and the conversions (the server's file, read here to write the
answers), the MCP client (`tools.mcp`), the number comparison (`rewards.answers.numeric_answer`).

The server file comes with a checkout of agent-rl (examples/ is not part of the installed package);
the episodes of a process share one server process (`MCPEnv`'s default).
"""

from __future__ import annotations

import functools
import importlib.util
import random
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent_rl.core.audit_target import ANSWERED, AuditTarget, Target, answer_choices
from agent_rl.core.env import Task
from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import Message, Reward, ToolCall
from agent_rl.envs.mcp_env import MCPEnv
from agent_rl.rewards.answers import numeric_answer, rational
from agent_rl.tools.mcp import MCPServerSpec, mcp_server

SERVER_FILE = Path(__file__).resolve().parents[1] / "examples" / "mcp_units_server.py"
SYSTEM = ("Answer the unit conversion question with the convert tool (list_units names the units it "
          "knows), then give the final answer as a number.")
REL_TOL = 1e-5  # answers and tool results carry 6 significant digits: a neighbour (1744.5 for 1743.5) is wrong
NAMES = {"m": "meters", "km": "kilometers", "cm": "centimeters", "mm": "millimeters", "mi": "miles", "yd": "yards",
         "ft": "feet", "in": "inches", "kg": "kilograms", "g": "grams", "lb": "pounds", "oz": "ounces",
         "l": "liters", "ml": "milliliters", "gal": "US gallons", "cup": "US cups",
         "C": "degrees Celsius", "F": "degrees Fahrenheit", "K": "kelvin"}


@functools.cache
def units_module() -> Any:
    """The server's module, loaded for its table (it imports the MCP SDK only when it serves)."""
    if not SERVER_FILE.is_file():
        raise FileNotFoundError(f"agent_rl.envs.mcp_units needs {SERVER_FILE} from a checkout of agent-rl; "
                                "it is missing")
    spec = importlib.util.spec_from_file_location("mcp_units_server", SERVER_FILE)
    assert spec is not None and spec.loader is not None  # a .py file that exists has both
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def units_server(url: str | None = None) -> MCPServerSpec:
    """The units server: at `url` over streamable HTTP, else started over stdio from SERVER_FILE."""
    if url:
        return mcp_server(url, name="units")
    units_module()  # a missing file is a clear error here, not a failed process start later
    return mcp_server([sys.executable, str(SERVER_FILE)], name="units")


class UnitsEnv(MCPEnv):
    """One conversion question; the episode ends when the model answers without a tool call."""

    def __init__(self, task: Task, shared: bool = True):
        for key in ("question", "answer"):
            if key not in task:
                raise ValueError(f"mcp_units task {task.get('id', '?')!r} has no {key!r} column")
        url = task.get("mcp_url")
        if url is not None and not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            raise ValueError(f"mcp_units task {task.get('id', '?')!r}: column 'mcp_url' must be an http(s) URL, "
                             f"got {url!r}")
        super().__init__([units_server(url)], shared=shared)
        self.task = task

    async def initial_messages(self) -> list[Message]:
        return [Message("system", SYSTEM), Message("user", str(self.task["question"]))]

    async def reward(self, messages: Sequence[Message]) -> Reward:
        final = messages[-1].content if messages and messages[-1].role == "assistant" else ""
        correct = numeric_answer(final, self.task["answer"], rel_tol=REL_TOL)
        return Reward(correct, {"correct": correct})


def unit_tasks(n: int, seed: int = 0) -> list[Task]:
    """Deterministic questions cycling through length, mass, volume and temperature."""
    units = units_module()
    by_kind: dict[str, list[str]] = {}
    for unit, (kind, _) in units.UNITS.items():
        by_kind.setdefault(kind, []).append(unit)
    kinds = sorted(by_kind)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        from_unit, to_unit = rng.sample(by_kind[kinds[i % len(kinds)]], 2)
        value = rng.choice([rng.randint(1, 100), rng.randint(1, 200) / 2])
        answer = float(f"{units.convert_value(value, from_unit, to_unit):.6g}")
        question = (f"What is {value:g} {NAMES[from_unit]} in {NAMES[to_unit]}?"
                    if kinds[i % len(kinds)] == "temperature"
                    else f"How many {NAMES[to_unit]} are in {value:g} {NAMES[from_unit]}?")
        rows.append({"id": f"units-{seed}-{i}", "question": question, "answer": answer,
                     "value": value, "from_unit": from_unit, "to_unit": to_unit})
    return rows


_RESULT = re.compile(r"^[^\n]*= (-?[\d.e+-]+) \S+$")


def solve(task: Task, messages: Sequence[Message], direct: bool = False) -> Message:
    """The demonstration: one `convert` call, then the number it returned. With `direct`, the answer at once."""
    if direct:
        return Message("assistant", f"The answer is {units_module().show(task['answer'])}.")
    results = [m.group(1) for msg in messages if msg.role == "tool" and (m := _RESULT.match(msg.content))]
    if not results:
        call = ToolCall("convert", {"value": task["value"], "from_unit": task["from_unit"], "to_unit": task["to_unit"]})
        return Message("assistant", "", (call,))
    return Message("assistant", f"The answer is {results[-1]}.")


def make_env(task: Task) -> UnitsEnv:
    return UnitsEnv(task)


def load_tasks(n: int, seed: int = 0, split: str = "train") -> list[Task]:
    """`n` conversion questions; the eval split uses a disjoint seed stream."""
    return unit_tasks(n, seed=seed + (1_000_003 if split != "train" else 0))


def audit_target(task: Task, tasks: Sequence[Task]) -> Target:
    """The task as the reward audit's hacks see it: the answer as the server writes numbers (plain, 6
    significant digits) and the numbers next to it; list_units as a probe (no answer in it); the answer
    in a convert call's arguments."""
    gold = units_module().show(task["answer"])
    carrier = ToolCall("convert", {"value": task["answer"], "from_unit": task["to_unit"], "to_unit": task["to_unit"]})
    return Target(task, str(task["question"]), gold, fmt="The answer is {}.", probes=(ToolCall("list_units", {}),),
                  carrier=carrier, **answer_choices(gold, [t["answer"] for t in tasks], value=rational(gold)))


ENV = EnvSpec("mcp_units", make_env, load_tasks, solve=solve, audit=AuditTarget(ANSWERED, audit_target))
