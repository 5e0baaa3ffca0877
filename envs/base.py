"""Environments whose actions are tool calls on typed Python functions.

Owns: `ToolEnv`, the base class of tool-using environments: dispatching the tool calls the renderer
parsed out of an assistant turn, one tool message back per attempted call, in order (a call past
`max_parallel_calls` is not run, and its message says so).
Does not own: the environment protocol (`agent_rl.core.env`: `Env`, `StepResult`, re-exported here
for environment authors), parsing calls out of text (the renderer), tokens, sampling, or rewards.

A subclass usually only writes `initial_messages` and `reward`; tools are passed in as functions,
bound methods or `tools.base.Tool` objects.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from agent_rl.core.env import Env, StepResult
from agent_rl.core.types import Message, StopReason, ToolCall, ToolCallRecord
from agent_rl.tools.base import ToolLike, ToolResult, as_tools

__all__ = ["Env", "StepResult", "ToolEnv"]


class ToolEnv(Env):
    """An environment whose actions are calls to typed Python functions.

    An assistant turn with no attempted tool call ends the episode (the model answered). Every
    attempted call gets exactly one tool message back, in order: the tool's output, or what was
    wrong (malformed JSON, unknown tool, invalid arguments, unclosed tag); the episode goes on.
    """

    tools: Sequence[ToolLike]  # what `Env.tools` promises (a name, a schema), and what it takes to call one

    def __init__(self, tools: Sequence[Callable[..., Any] | ToolLike], max_parallel_calls: int = 8):
        self.tools = as_tools(list(tools))
        self._by_name = {t.name: t for t in self.tools}
        self.max_parallel_calls = max_parallel_calls

    async def step(self, reply: Message, turn: int) -> StepResult:
        calls = reply.tool_calls
        if not calls:
            return StepResult(done=True, stop_reason=StopReason.NO_TOOL_CALL)
        limit = self.max_parallel_calls
        results = await asyncio.gather(*(self._run(call) for call in calls[:limit]))
        results += [self._over_limit(call, k) for k, call in enumerate(calls[limit:], start=limit + 1)]
        messages = tuple(Message("tool", res.content, name=name) for name, res, _ in results)
        records = tuple(ToolCallRecord(name=name, ok=res.ok, error=res.error, latency_s=dt, turn=turn)
                        for name, res, dt in results)
        return StepResult(messages=messages, tool_calls=records)

    def _over_limit(self, call: ToolCall, k: int) -> tuple[str, ToolResult, float]:
        msg = f"call {k} not run: at most {self.max_parallel_calls} tool calls per turn; make it in the next turn"
        name = "<invalid>" if call.error is not None else call.name
        return name, ToolResult(ok=False, content=f"Error: {msg}", error=msg), 0.0

    async def _run(self, call: ToolCall) -> tuple[str, ToolResult, float]:
        if call.error is not None:
            return "<invalid>", ToolResult(ok=False, content=f"Error: {call.error}", error=call.error), 0.0
        tool = self._by_name.get(call.name)
        if tool is None:
            msg = f"unknown tool {call.name!r}; available tools: {', '.join(self._by_name) or 'none'}"
            return call.name, ToolResult(ok=False, content=f"Error: {msg}", error=msg), 0.0
        t0 = time.perf_counter()
        result = await tool.call(call.arguments)
        return call.name, result, time.perf_counter() - t0
