"""The environment API: small, async, message-level, single-use classes.

Owns: `Env` (what the rollout runner talks to), `StepResult`, and `ToolEnv`, the base class for
environments whose actions are tool calls on typed Python functions.
Does not own: tokens (the runner and `agent_rl.chat` handle those), sampling, or reward weighting.

An episode, as the runner plays it:

    async with make_env(task) as env:             # the env owns its resources (sandboxes, clients)
        messages = await env.initial_messages()   # system + user
        while True:
            reply = <the policy samples an assistant message>
            result = await env.step(reply)        # tool results / follow-ups, done?
            if result.done: break
        reward = await env.reward(all_messages)

A subclass of `ToolEnv` usually only writes `initial_messages` and `reward`; tools are passed in
as functions or bound methods.
"""

from __future__ import annotations

import abc
import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from agent_rl.toolcalls import parse_tool_calls
from agent_rl.types import Message, StopReason, ToolCallRecord
from tools.base import Tool, ToolResult, as_tools


@dataclass(frozen=True)
class StepResult:
    """What the environment says after one assistant turn."""

    messages: tuple[Message, ...] = ()  # user or tool messages to append
    done: bool = False
    stop_reason: StopReason = StopReason.ENV_DONE  # read only when done
    tool_calls: tuple[ToolCallRecord, ...] = ()


class Env(abc.ABC):
    """One episode of one task. Use it once, inside `async with`."""

    tools: Sequence[Tool] = ()

    async def __aenter__(self) -> "Env":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Release what the environment owns (sandboxes, HTTP sessions)."""

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools]

    @abc.abstractmethod
    async def initial_messages(self) -> list[Message]:
        """The opening conversation: an optional system message, then the user's task."""

    @abc.abstractmethod
    async def step(self, reply: Message, turn: int) -> StepResult:
        """React to the policy's assistant message (its exact sampled text in `reply.content`)."""

    @abc.abstractmethod
    async def reward(self, messages: Sequence[Message]) -> float:
        """Score the finished conversation."""

    def reward_parts(self) -> dict[str, float]:
        """Named reward components and metrics of the last `reward` call (logged, weight-free)."""
        return {}


class ToolEnv(Env):
    """An environment whose actions are calls to typed Python functions.

    An assistant turn with no attempted tool call ends the episode (the model answered). Every
    attempted call gets exactly one tool message back, in order: the tool's output, or what was
    wrong (malformed JSON, unknown tool, invalid arguments, unclosed tag); the episode goes on.
    """

    def __init__(self, tools: Sequence[Callable[..., Any] | Tool], max_parallel_calls: int = 8):
        self.tools = as_tools(list(tools))
        self._by_name = {t.name: t for t in self.tools}
        self.max_parallel_calls = max_parallel_calls

    async def step(self, reply: Message, turn: int) -> StepResult:
        parsed = parse_tool_calls(reply.content)
        if not parsed:
            return StepResult(done=True, stop_reason=StopReason.NO_TOOL_CALL)
        parsed = parsed[: self.max_parallel_calls]
        results = await asyncio.gather(*(self._run(p.call, p.error) for p in parsed))
        messages = tuple(Message("tool", res.content, name=name) for name, res, _ in results)
        records = tuple(ToolCallRecord(name=name, ok=res.ok, error=res.error, latency_s=dt, turn=turn)
                        for name, res, dt in results)
        return StepResult(messages=messages, tool_calls=records)

    async def _run(self, call: Any, parse_error: str | None) -> tuple[str, ToolResult, float]:
        if call is None:
            return "<invalid>", ToolResult(ok=False, content=f"Error: {parse_error}", error=parse_error), 0.0
        tool = self._by_name.get(call.name)
        if tool is None:
            msg = f"unknown tool {call.name!r}; available tools: {', '.join(self._by_name) or 'none'}"
            return call.name, ToolResult(ok=False, content=f"Error: {msg}", error=msg), 0.0
        t0 = time.perf_counter()
        result = await tool.call(call.arguments)
        return call.name, result, time.perf_counter() - t0
