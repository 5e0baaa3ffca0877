"""Bring your own agent: an episode is an async agent function that calls the policy through an
OpenAI-compatible endpoint, and the rollout runner records it token for token.

Owns: `AgentEnv`, an `Env` whose episode is `await agent(task, base_url)` (agent code written with
the `openai` client, or any framework that speaks that API), scored by `reward(task, messages,
answer)` over the finished conversation and the agent's return value; `AgentError`.
Does not own: HTTP and the wire format (`envs.agent_proxy`); tokens: the runner renders the
conversation with the policy's renderer, samples from the run's servers (same seeds per task,
rollout and turn as any env), records ids, mask and log-probs and starts segments; the agent (yours).

Control is inverted through the ordinary runner, so an agent's trajectory is made exactly as a native
env's is: `initial_messages` starts the agent and returns the messages of its first request; the
runner samples a turn and calls `step(reply)`, which answers the agent's waiting request with that
reply and waits for its next request (or its return). When the next request is the conversation so
far plus new user or tool messages, those are the step's messages and the runner appends their
rendered delta after the sampled ids; any other history (the agent edited, truncated or reordered
it, or changed its tools) comes back as `StepResult.history`, which the runner renders whole: a new
training segment, unless that render extends the token buffer. Nothing sampled is re-tokenised.

Ends: the agent returns (the episode ends as a native env's: `no_tool_call` after a reply without
calls, else `env_done`); or the runner stops it (a turn cut at max_tokens_per_turn goes back with
finish_reason "length"; max_turns, the token budget, an error): later requests get HTTP 410
`episode ... is over: <why>`, and an agent that raises after that refusal has ended normally. An
agent that raises otherwise, returns before asking anything or outlives a deadline (`AgentEnv`)
makes the episode an infrastructure error (`StopReason.ERROR`, one line in the trajectory's `error`).
Sampling settings are the run's (on-policy): a request's temperature, max_tokens, stop... are ignored.
"""

from __future__ import annotations

import asyncio
import inspect
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from agent_rl.core.env import Env, StepResult, Task
from agent_rl.core.types import Message, Reward, StopReason, ToolCallRecord
from agent_rl.envs.agent_proxy import ChatRequest, Proxy, ProxyError, completion, local_proxy, parse_request

Agent = Callable[[Task, str], Coroutine[Any, Any, Any]]  # async agent(task, base_url) -> its answer (anything)
Scorer = Callable[[Task, Sequence[Message], Any], "float | Reward | Awaitable[float | Reward]"]


class AgentError(Exception):
    """The agent failed: it raised, returned before asking the model anything, or stopped waiting."""


@dataclass
class _Request:
    request: ChatRequest
    reply: asyncio.Future  # the completion body, or a ProxyError, for the waiting HTTP handler
    received: float


class AgentEnv(Env):
    """One task played by `agent(task, base_url)`; `reward(task, messages, answer)` (sync or async)
    scores it. Deadlines, each ending a hung agent with one line: `request_timeout_s` bounds each
    request's wait for its reply; `agent_timeout_s` the agent's own time from its start or a reply to
    its next request or return, its tools included (below the runner's env_timeout_s, 120 s by default,
    so the error names the agent); `finish_timeout_s` its time to return once its episode is over."""

    def __init__(self, task: Task, agent: Agent, reward: Scorer, *, request_timeout_s: float = 600.0,
                 agent_timeout_s: float = 100.0, finish_timeout_s: float = 10.0):
        self.task, self.agent, self.scorer = task, agent, reward
        self.request_timeout_s, self.finish_timeout_s = request_timeout_s, finish_timeout_s
        self.agent_timeout_s = agent_timeout_s
        self.key = secrets.token_urlsafe(12)  # the episode's part of its base URL: unguessable, one per episode
        self.base_url = ""
        self.answer: Any = None  # what the agent returned
        self._proxy: Proxy | None = None
        self._task: asyncio.Task | None = None
        self._inbox: asyncio.Queue[_Request] = asyncio.Queue()
        self._pending: _Request | None = None  # the request the runner samples for next
        self._conversation: list[Message] = []  # what the runner's context holds, as messages
        self._tools: tuple[dict[str, Any], ...] = ()
        self._replies: dict[str, tuple[Message, int]] = {}  # tool-call id sent -> (reply, call index)
        self._sent: Message | None = None  # the last reply delivered
        self._count = 0  # replies delivered
        self._over: str | None = None  # why later requests are refused
        self._refused = False

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return list(self._tools)  # the `tools` of the agent's latest request

    # -- the runner's side --------------------------------------------------------------------------
    async def initial_messages(self) -> list[Message]:
        self._proxy = await asyncio.to_thread(local_proxy)
        loop = asyncio.get_running_loop()
        self.base_url = self._proxy.register(self.key, self._handle, loop, self.request_timeout_s)
        self._task = asyncio.create_task(self.agent(self.task, self.base_url), name=f"agent {self.key}")
        first = await self._next("sent no request within {:g} s of its start")
        if first is None:
            raise AgentError("the agent returned before asking the model anything")
        self._conversation, self._tools = list(first.request.messages), first.request.tools
        return list(self._conversation)

    async def step(self, reply: Message, turn: int) -> StepResult:
        self._deliver(reply, "stop")
        t0 = time.perf_counter()
        nxt = await self._next("neither asked the model again nor returned within {:g} s of its reply")
        records = self._records(reply, turn, (nxt.received if nxt else time.perf_counter()) - t0)
        if nxt is None:
            stop = StopReason.ENV_DONE if reply.tool_calls else StopReason.NO_TOOL_CALL
            return StepResult(done=True, stop_reason=stop, tool_calls=records)
        old, new = self._conversation, list(nxt.request.messages)
        extends = (nxt.request.tools == self._tools and new[:len(old)] == old
                   and all(m.role in ("user", "tool") for m in new[len(old):]))
        self._conversation, self._tools = new, nxt.request.tools
        if extends:
            return StepResult(messages=tuple(new[len(old):]), tool_calls=records)
        return StepResult(history=tuple(new), tool_calls=records)

    async def reward(self, messages: Sequence[Message]) -> float | Reward:
        last = messages[-1] if messages else None
        pending = self._pending is not None and not self._pending.reply.done()
        if pending and last is not None and last.role == "assistant" and last is not self._sent:
            self._over = 'its last turn was cut at the run\'s max_tokens_per_turn (finish_reason "length")'
            self._deliver(last, "length")
        elif pending:
            self._over = "the run's turn or token limit ended it (rollout.max_turns, rollout.max_total_tokens)"
        self._over = self._over or "the agent returned"
        self._refuse()
        if self._task is not None:
            if not (await asyncio.wait({self._task}, timeout=self.finish_timeout_s))[0]:
                raise AgentError(f"the agent did not return within {self.finish_timeout_s:g} s after its episode "
                                 f"ended ({self._over})")
            self._take_answer()
        value = self.scorer(self.task, messages, self.answer)
        return await value if inspect.isawaitable(value) else value

    async def close(self) -> None:
        self._over = self._over or "the run stopped it (an error or a deadline: the trajectory's error says which)"
        self._refuse()
        if self._proxy is not None:
            self._proxy.unregister(self.key)
        task = self._task
        if task is not None and not task.done():
            if not (await asyncio.wait({task}, timeout=self.finish_timeout_s))[0]:
                task.cancel()
                await asyncio.wait({task}, timeout=self.finish_timeout_s)
        if task is not None and task.done() and not task.cancelled():
            task.exception()  # retrieved: an agent's failure is the episode's error, not a warning at exit

    # -- the agent's side ---------------------------------------------------------------------------
    async def _handle(self, body: dict[str, Any]) -> dict[str, Any]:
        """One HTTP request (on this env's loop): queued for the runner; returns the reply's completion."""
        if self._over is not None:
            self._refused = True
            raise ProxyError(410, f"episode {self.key} is over: {self._over}", "episode_over")
        if self._pending is not None:
            raise ProxyError(400, f"episode {self.key} already has a request waiting for its reply; an episode is "
                                  "one conversation: send its requests one at a time")
        request = _Request(parse_request(body, self._replies), asyncio.get_running_loop().create_future(),
                           time.perf_counter())
        self._pending = request
        self._inbox.put_nowait(request)
        return await request.reply

    async def _next(self, hung: str) -> _Request | None:
        """The agent's next request, or None when it returned (its exception raised as AgentError);
        AgentError "the agent <hung>" when it does neither within agent_timeout_s."""
        assert self._task is not None
        get = asyncio.ensure_future(self._inbox.get())
        try:
            await asyncio.wait({get, self._task}, timeout=self.agent_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not get.done():
                get.cancel()
        if get.done() and not get.cancelled():
            return get.result()
        if not self._task.done():
            raise AgentError(f"the agent {hung.format(self.agent_timeout_s)} (AgentEnv agent_timeout_s)")
        self._take_answer()
        return None

    def _take_answer(self) -> None:
        assert self._task is not None and self._task.done()
        if self._task.cancelled():
            raise AgentError("the agent was cancelled")
        error = self._task.exception()
        if error is None:
            self.answer = self._task.result()
        elif not self._refused:  # an exception after a refusal is how an openai-client agent learns the end
            raise AgentError(f"the agent raised {type(error).__name__}: {error}") from error

    def _deliver(self, reply: Message, finish_reason: str) -> None:
        request, self._pending = self._pending, None
        self._count += 1
        ids = [f"call_{self._count}_{k + 1}" for k in range(len(reply.tool_calls))]
        self._replies.update({i: (reply, k) for k, i in enumerate(ids)})
        self._conversation.append(reply)
        self._sent = reply
        if request is None or request.reply.done():
            raise AgentError(f"the agent stopped waiting for its reply (request_timeout_s={self.request_timeout_s:g})")
        body = completion(reply, ids, finish_reason, request.request.model, f"chatcmpl-{self.key}-{self._count}")
        request.reply.set_result(body)

    def _refuse(self) -> None:
        request, self._pending = self._pending, None
        if request is not None and not request.reply.done():
            request.reply.set_exception(ProxyError(410, f"episode {self.key} is over: {self._over}", "episode_over"))
            self._refused = True

    def _records(self, reply: Message, turn: int, latency_s: float) -> tuple[ToolCallRecord, ...]:
        """The reply's calls as attempts: ok when it parsed and names a tool the request offered (what the
        agent did with it is its own business); latency is the agent's time until its next request."""
        offered = [t["function"]["name"] for t in self._tools]
        out = []
        for call in reply.tool_calls:
            unknown = f"unknown tool {call.name!r}; available tools: {', '.join(offered) or 'none'}"  # as ToolEnv says
            error = call.error or (None if call.name in offered else unknown)
            out.append(ToolCallRecord(name=call.name if call.ok else "<invalid>", ok=error is None, error=error,
                                      latency_s=latency_s, turn=turn))
        return tuple(out)
