"""The agent seat a verifiers environment's `run()` talks to, when agent-rl's runner is the agent.

Owns: `Seat` (what `run(task, agents)` gets as `agents.<name>`: `run(task)` for one segment,
`interaction(task)` for a turn-by-turn exchange), `Bridge` (the hand-over between the environment's
`run()`, which waits in a seat for the model's answer, and the runner, which samples it), the verifiers
`Trace` an episode builds (`open_trace`, `add_nodes`) and the toolsets' tools as agent-rl tools
(`toolset_tools`, each call seeing the episode's verifiers state), the task's `@vf.stop` hooks (`stop_hooks`,
`stopped_by`), and the reading of verifiers messages (`from_verifiers`: text; any other content, an image,
`UnsupportedContent`).
Does not own: loading verifiers environments, task rows, or the `Env` the runner plays
(`envs.verifiers_env`); tokens (the runner and the renderer).

Control is inverted, as for `envs.agent_env`: verifiers' own `run()` is the episode's driver (its
engine plays the user: a game, an OpenEnv server, a simulated user), and each time it asks its seat for
the model's next segment the request waits in the `Bridge` until the runner has sampled it. A segment
is what a verifiers harness segment is: assistant turns and tool results until a reply without a tool
call. Leaving an interaction (or the end of `run(task)`) scores the trace with the task's own
`@vf.reward` / `@vf.metric` hooks (`Task.score`), as verifiers' rollout does on close.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
from collections.abc import Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.agent import Segment
from verifiers.v1.graph import MessageNode
from verifiers.v1.mcp.server import _call_state
from verifiers.v1.session import call_hook, hook_boundary
from verifiers.v1.state import state_cls
from verifiers.v1.trace import AgentInfo, Trace, TraceTask
from verifiers.v1.types import Request as VfRequest
from verifiers.v1.types import Response as VfResponse
from verifiers.v1.types import TextContentPart, content_text
from verifiers.v1.utils.decorators import discover_decorated

from agent_rl.core.types import Message
from agent_rl.tools.base import Tool


@dataclass
class Request:
    """The environment asks for the model's next segment, after these new user messages."""

    messages: list[Message]
    reply: asyncio.Future  # -> the segment's messages (list[Message]), or None when the runner ended it


@dataclass
class Bridge:
    """One episode's hand-over point: the environment puts requests in, the runner answers them."""

    inbox: asyncio.Queue[Request] = field(default_factory=asyncio.Queue)
    traces: list[Trace] = field(default_factory=list)
    state: Any = None  # the episode's verifiers state, shared by its trace and its tools

    async def ask(self, messages: list[Message]) -> list[Message] | None:
        request = Request(messages, asyncio.get_running_loop().create_future())
        self.inbox.put_nowait(request)
        return await request.reply


def open_trace(task: vf.Task, bridge: Bridge, seat: str) -> Trace:
    """A fresh verifiers trace of `task` for the seat, holding the task's system prompt and prompt."""
    if bridge.state is None:
        bridge.state = state_cls(type(task))()
    trace = Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                  agent=AgentInfo(config=vf.AgentConfig(), name=seat), state=bridge.state)
    add_nodes(trace, opening(task.data), sampled=False)
    bridge.traces.append(trace)
    return trace


def opening(data: vf.TaskData) -> list[Message]:
    """The task's system prompt and prompt as agent-rl messages (no prompt: the environment opens)."""
    out = [Message("system", data.system_prompt)] if data.system_prompt else []
    if isinstance(data.prompt, str):
        out.append(Message("user", data.prompt))
    elif data.prompt:
        out.extend(from_verifiers(m) for m in data.prompt)
    return out


class UnsupportedContent(ValueError):
    """The environment sent content no agent-rl chat format can render (an image): the episode ends, in one line."""


def from_verifiers(m: Any) -> Message:
    """A verifiers message as an agent-rl one: its text. Content that is not text (an image) is never dropped:
    it raises `UnsupportedContent`, naming it."""
    content = m.content if isinstance(m.content, str) else vf_text(m.content, m.role)
    if m.role == "assistant" and m.tool_calls:
        raise ValueError("a verifiers prompt with assistant tool calls cannot be rendered as a sampled turn")
    return Message(m.role, content or "", name=getattr(m, "name", None))


def vf_text(content: Any, role: str = "user") -> str:
    """The text of a verifiers message's content parts; a part of another kind raises `UnsupportedContent`."""
    other = sorted({getattr(part, "type", type(part).__name__) for part in content or []
                    if not isinstance(part, TextContentPart)})
    if other:
        raise UnsupportedContent(f"a {role} message holds {', '.join(other)} content, and agent-rl's chat formats "
                                 "(every model family's renderer) take text only: the episode ends here rather than "
                                 "drop it")
    return content_text(content)


def add_nodes(trace: Trace, messages: Sequence[Message], sampled: bool) -> None:
    """Append `messages` to the trace's one branch (assistant ones marked sampled when `sampled`). The
    n-th tool message after an assistant message answers its n-th call (one per attempted call, as
    `ToolEnv` answers them) and carries that call's id."""
    for m in messages:
        parent = len(trace.nodes) - 1 if trace.nodes else None
        trace.nodes.append(MessageNode(parent=parent, message=to_verifiers(m, trace), sampled=sampled and
                                       m.role == "assistant"))


def to_verifiers(m: Message, trace: Trace) -> Any:
    index = len(trace.nodes)
    if m.role == "system":
        return vf.SystemMessage(content=m.content)
    if m.role == "user":
        return vf.UserMessage(content=m.content)
    if m.role == "tool":
        asked = next((i for i in range(index - 1, -1, -1) if trace.nodes[i].message.role == "assistant"), -1)
        return vf.ToolMessage(tool_call_id=f"call_{asked}_{index - asked - 1}", content=m.content, name=m.name)
    calls = [vf.ToolCall(id=f"call_{index}_{k}", name=c.name or "<invalid>", arguments=json.dumps(c.arguments))
             for k, c in enumerate(m.tool_calls)]
    return vf.AssistantMessage(content=m.content, tool_calls=calls or None)


def stop_hooks(task: vf.Task) -> list[tuple[type, Any]]:
    """The task's `@vf.stop` hooks (decorated, or plugged in through its config), each with the boundary it reads:
    the trace, the request about to go to the model, or the model's response (verifiers' `hook_boundary`)."""
    return [(hook_boundary(fn, allow_trace=True), fn) for fn in task.hooks("stop")]


async def stopped_by(stops: Sequence[tuple[type, Any]], trace: Trace, pending: Sequence[Message],
                     reply: Message | None = None) -> str | None:
    """The name of the first stop hook that ends the episode, or None, as verifiers runs them: with `reply`, the
    response hooks on the model's reply (before its calls run); else, before the next model call, the trace hooks
    and then the request hooks. They see the trace with `pending` added (the segment so far, which the trace gets
    when the segment is answered)."""
    if not stops:
        return None
    n = len(trace.nodes)
    add_nodes(trace, pending, sampled=True)
    try:
        if reply is not None:
            hooks = [fn for boundary, fn in stops if boundary is VfResponse]
            available: dict[type, Any] = {Trace: trace, VfResponse: VfResponse(
                id="agent-rl", created=0, model="policy", message=to_verifiers(reply, trace),
                finish_reason="tool_calls" if reply.tool_calls else "stop")}
        else:
            hooks = [fn for b in (Trace, VfRequest) for boundary, fn in stops if boundary is b]
            available = {Trace: trace, VfRequest: VfRequest(messages=list(trace.messages))}
        for fn in hooks:
            result = await call_hook(fn, available)
            if not isinstance(result, bool):
                raise TypeError(f"@stop {fn.__name__} must return bool, got {type(result).__name__}")
            if result:
                return fn.__name__
        return None
    finally:
        del trace.nodes[n:]


class Seat:
    """`agents.<name>` inside one episode: the model behind it is agent-rl's policy."""

    def __init__(self, bridge: Bridge, name: str):
        self.bridge, self.name = bridge, name
        self.trainable = True

    async def run(self, task: vf.Task, **_: Any) -> Trace:
        """One segment on the task's prompt (what verifiers' `Agent.run` is), then the task's scoring."""
        trace = open_trace(task, self.bridge, self.name)
        segment = await self.bridge.ask([])
        add_nodes(trace, segment or [], sampled=True)
        trace.stop("agent_completed" if segment is not None else "max_turns")
        return await score(task, trace)

    @asynccontextmanager
    async def interaction(self, task: vf.Task, **_: Any):
        exchange = Exchange(task, open_trace(task, self.bridge, self.name), self.bridge)
        try:
            yield exchange
        finally:
            if exchange.trace.stop_condition is None:
                exchange.trace.stop("user_closed")
            await score(task, exchange.trace)


class Exchange:
    """verifiers' `Interaction`, answered by the runner: `turn(message)` returns the model's segment."""

    def __init__(self, task: vf.Task, trace: Trace, bridge: Bridge):
        self.task, self.trace, self.bridge = task, trace, bridge
        self._started = False
        self._over = False

    async def turn(self, message: Any = None) -> Segment:
        if self._over:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        prompted = not self._started and self.task.data.prompt is not None
        if message is None and not prompted:
            raise ValueError("nothing to run a turn on: this exchange takes its next user message")
        if message is not None and prompted:
            raise ValueError("the task's prompt opens this exchange: take its first reply with a bare turn()")
        self._started = True
        new = user_messages(message)
        add_nodes(self.trace, new, sampled=False)
        segment = await self.bridge.ask(new)
        if segment is None:  # the runner ended the episode (its turn or token limit)
            self._over = True
            self.trace.stop("max_turns")
            return Segment(messages=[], terminated=True)
        add_nodes(self.trace, segment, sampled=True)
        return Segment(messages=[n.message for n in self.trace.nodes[-len(segment):]])


def user_messages(message: Any) -> list[Message]:
    if message is None:
        return []
    if isinstance(message, str):
        return [Message("user", message)]
    return [from_verifiers(vf.UserMessage(**m) if isinstance(m, dict) else m) for m in message]


async def score(task: vf.Task, trace: Trace) -> Trace:
    """The task's rewards, metrics and judges on the finished trace (no runtime: offline signals only)."""
    await task.score(trace)
    trace.is_completed = True
    trace.ok = not trace.errors
    return trace


class Seats:
    """The `agents` a verifiers `Env.run` receives: one seat per agent role of its config, all played by the
    policy (a role that must not train, such as a judge, is refused where the environment is loaded)."""

    def __init__(self, bridge: Bridge, names: Sequence[str]):
        self._seats = {name: Seat(bridge, name) for name in names}

    def __getattr__(self, name: str) -> Seat:
        seats = self.__dict__.get("_seats", {})
        if name not in seats:
            raise AttributeError(f"this environment has no agent role {name!r} (roles: {', '.join(seats)})")
        return seats[name]


def toolset_tools(toolset: Any, bridge: Bridge) -> list[Tool]:
    """A verifiers `Toolset`'s `@vf.tool` methods as agent-rl tools, named as verifiers advertises them
    (`<server>_<tool>`, or bare when `TOOL_PREFIX` is None); each call sees the episode's state."""
    prefix = toolset.server_name
    tools = []
    for fn in discover_decorated(toolset, "tool"):
        name = getattr(fn, "tool_name", None) or fn.__name__
        tools.append(Tool(_with_state(fn, bridge), name=f"{prefix}_{name}" if prefix else name))
    return tools


def _with_state(fn: Any, bridge: Bridge) -> Any:
    """`fn` as an async function that runs with the episode's state as the toolset's `self.state`; a sync
    tool runs in a thread (which copies the state's context), so a slow one does not stall the event loop."""

    @functools.wraps(fn)
    async def call(**kwargs: Any) -> Any:
        token = _call_state.set(bridge.state)
        try:
            if inspect.iscoroutinefunction(fn):
                return await fn(**kwargs)
            return await asyncio.to_thread(fn, **kwargs)
        finally:
            _call_state.reset(token)

    return call
