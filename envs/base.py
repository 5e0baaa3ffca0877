"""Environments whose actions are tool calls on typed Python functions.

Owns: `ToolEnv`, the base class of tool-using environments: dispatching the tool calls the renderer parsed out of an
assistant turn, one tool message back per attempted call, in order (a call past `max_parallel_calls` is not run, and
its message says so), and the turn's own reward (`turn_reward`, none unless a subclass says; a turn cut at its token
limit gets a failed call's, `unparsed_turn_reward`); the switch every built-in environment's turn rewards share (a
task's `turn_rewards` column, `turn_rewards_on`, written by `load_tasks(..., turn_rewards=True)`:
`with_turn_rewards`) and the commonest rule, a penalty per failed call (`failed_calls`).
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

from agent_rl.core.env import Env, StepResult, Task
from agent_rl.core.types import Message, Reward, StopReason, ToolCall, ToolCallRecord
from agent_rl.tools.base import ToolLike, ToolResult, as_tools

__all__ = ["Env", "StepResult", "ToolEnv"]

# a turn's reward for each wasted action (a failed call, a refused action), where turn rewards are on
TURN_PENALTY = -0.1


def turn_rewards_on(task: Task) -> bool:
    """Whether a task row asks for turn rewards (its `turn_rewards` column; absent: no); ValueError when the
    column is not a boolean."""
    on = task.get("turn_rewards", False)
    if not isinstance(on, bool):
        raise ValueError(f"task {task.get('id', '?')!r}: column 'turn_rewards' must be true or false "
                         f"(got {on!r})"[:300])
    return on


def with_turn_rewards(rows: list[Task], on: bool) -> list[Task]:
    """The rows with `turn_rewards: true` in each when `on` (a `load_tasks` argument, so a config turns them on
    with `rollout.env_args: {turn_rewards: true}`); as they are otherwise."""
    if not isinstance(on, bool):
        raise ValueError(f"turn_rewards must be true or false (got {on!r})")
    return [{**row, "turn_rewards": True} for row in rows] if on else rows


def failed_calls(records: Sequence[ToolCallRecord]) -> Reward:
    """TURN_PENALTY per call of the turn that failed (unreadable, unknown tool, invalid arguments, the tool's
    own error), as the part `tool_errors`."""
    failed = sum(not r.ok for r in records)
    value = TURN_PENALTY * failed if failed else 0.0
    return Reward(value, {"tool_errors": value})


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
        run = calls[:limit]
        if len(run) == 1:  # the common case: one call needs no task of its own, nor a gather
            results = [await self._run(run[0])]
        else:
            results = list(await asyncio.gather(*(self._run(call) for call in run)))
        results += [self._over_limit(call, k) for k, call in enumerate(calls[limit:], start=limit + 1)]
        messages = tuple(Message("tool", res.content, name=name) for name, res, _ in results)
        records = tuple(ToolCallRecord(name=name, ok=res.ok, error=res.error, latency_s=dt, turn=turn)
                        for name, res, dt in results)
        return StepResult(messages=messages, tool_calls=records, reward=self.turn_reward(records))

    async def unparsed_turn_reward(self, turn: int) -> float | Reward | None:
        """A turn cut at its token limit is a failed call: the reward of a turn whose one call could not be read
        (no tool runs), by this environment's own rule (`turn_reward`, or a subclass's `step`)."""
        unread = ToolCall("", {}, error="the turn was cut at its token limit before it ended")
        return (await self.step(Message("assistant", "", (unread,)), turn)).reward

    def turn_reward(self, records: Sequence[ToolCallRecord]) -> float | Reward | None:
        """The reward of a turn whose calls went as `records` say (`StepResult.reward`); None (the default):
        none. An environment with turn rewards overrides it, e.g. with `failed_calls`."""
        return None

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
