"""The OpenAI-compatible endpoint that agent code talks to during an episode (`envs.agent_env`).

Owns: the process's proxy server (`local_proxy`): one aiohttp app on 127.0.0.1 serving one base URL
per open episode, `http://127.0.0.1:PORT/episodes/<key>/v1`, so an unmodified
`openai.AsyncOpenAI(base_url=...)` (or any framework that speaks that API) works; the episode table
(a key per episode, with its request handler, its event loop and its deadline); the OpenAI wire
format: `parse_request` (a request's messages and tools as agent-rl `Message`s), `completion` (a
sampled turn as a `chat.completion` with `tool_calls`), and errors as OpenAI error JSON with one
clear message, sent with `x-should-retry: false` so that clients do not resend what cannot succeed.
Does not own: what an episode does with a request (`envs.agent_env.AgentEnv`), rendering, sampling
and the token buffer (the rollout runner plays the episode; this module only carries messages).

Where the server runs: on a daemon thread with its own event loop, started on first use, as
`envs.kg_qa` starts its service and for the same reason: one process plays many loops (each
`asyncio.run` of the CLI, the trainer, a test session) and the server must outlive all of them.
A request is handed to the loop of the episode it names (`run_coroutine_threadsafe`) and answered
under that episode's deadline.

Routes, under `/episodes/<key>/v1`: `POST /chat/completions` and `GET /models`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from agent_rl.core.types import Message, ToolCall
from agent_rl.tools.http_service import ProcessService

START_DEADLINE_S = 60.0
MAX_BODY_BYTES = 64 * 2**20  # a long agent conversation, resent whole with every request
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
TOOL_SHAPE = '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}'


class ProxyError(Exception):
    """A request the proxy cannot answer: `status` is the HTTP status, `message` the one line the agent reads."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


@dataclass(frozen=True)
class ChatRequest:
    """A `/chat/completions` request as agent-rl messages (a reply this proxy sampled is that very message)."""

    model: str
    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...]


# -- the wire format ------------------------------------------------------------------------------

def parse_request(body: Mapping[str, Any], replies: Mapping[str, tuple[Message, int]]) -> ChatRequest:
    """A request body as messages. `replies` maps the tool-call ids this episode's replies carried to
    (reply, index of the call): an assistant message carrying them is that reply, exact text included."""
    if body.get("stream"):
        raise ProxyError(400, "stream: streaming is not supported by the agent-rl proxy; send stream=false")
    if body.get("n") not in (None, 1):
        raise ProxyError(400, f"n: one choice per request (n=1), got {body.get('n')!r}: an episode is one conversation")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProxyError(400, "messages: a non-empty list of chat messages is required")
    calls: dict[str, ToolCall] = {}  # the tool calls of this request's assistant messages, by id
    out = tuple(_message(f"messages[{i}]", m, replies, calls) for i, m in enumerate(messages))
    model = body.get("model")
    return ChatRequest(model if isinstance(model, str) else "", out, _tools(body.get("tools")))


def _tools(tools: Any) -> tuple[dict[str, Any], ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise ProxyError(400, f"tools: must be a list of {TOOL_SHAPE}")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (t.get("type") == "function" and isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and fn["name"]):
            raise ProxyError(400, f"tools[{i}]: expected {TOOL_SHAPE}")
    return tuple(tools)


def _text(where: str, content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ProxyError(400, f"{where}.content[{j}]: only text parts are supported, got {kind!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise ProxyError(400, f"{where}.content: must be a string or a list of text parts, got {type(content).__name__}")


def _message(where: str, m: Any, replies: Mapping[str, tuple[Message, int]], calls: dict[str, ToolCall]) -> Message:
    if not isinstance(m, dict):
        raise ProxyError(400, f"{where}: must be an object with a role and content")
    role = ROLES.get(m.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise ProxyError(400, f"{where}: unknown role {m.get('role')!r}; use system, user, assistant or tool")
    text = _text(where, m.get("content"))
    if role == "assistant":
        return _assistant(where, text, m.get("tool_calls"), replies, calls)
    if role == "tool":  # named as the runner names a tool message: the call's tool, "<invalid>" for a malformed call
        call = calls.get(m.get("tool_call_id"))  # type: ignore[arg-type]
        return Message("tool", text, name=None if call is None else call.name if call.ok else "<invalid>")
    return Message(role, text)  # type: ignore[arg-type]


def _assistant(where: str, text: str, wire: Any, replies: Mapping[str, tuple[Message, int]],
               calls: dict[str, ToolCall]) -> Message:
    if not wire:
        return Message("assistant", text)
    if not isinstance(wire, list) or not all(isinstance(c, dict) for c in wire):
        raise ProxyError(400, f"{where}.tool_calls: must be a list of tool-call objects")
    found = [replies.get(c.get("id")) for c in wire]
    if found[0] is None:
        raise ProxyError(400, f"{where}: an assistant message with tool_calls that this proxy did not sample; "
                              "an assistant turn is rendered from its content, so write such calls into the "
                              "content in the model's own format and leave tool_calls out")
    reply = found[0][0]
    same = found == [(reply, k) for k in range(len(reply.tool_calls))]
    if not (same and [_wire_call(c) for c in wire] == [(c.name, c.arguments) for c in reply.tool_calls]
            and text in ("", reply.content)):
        raise ProxyError(400, f"{where}: a reply this proxy sampled, with its content or tool_calls changed; send "
                              "sampled replies back as they came "
                              "(or leave them out: that starts a new training segment)")
    for c, (_, k) in zip(wire, found):  # type: ignore[misc]
        calls[c["id"]] = reply.tool_calls[k]
    return reply


def _wire_call(c: dict[str, Any]) -> tuple[Any, Any]:
    fn = c.get("function")
    if not isinstance(fn, dict):
        fn = {}
    args = fn.get("arguments")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass
    return fn.get("name"), args


def completion(reply: Message, call_ids: Sequence[str], finish_reason: str, model: str, completion_id: str) -> dict:
    """A sampled assistant turn as a `chat.completion`. `content` is the exact text sampled, tool-call
    markup included (what keeps a resent history token-exact); `tool_calls` are the renderer's parse,
    a malformed call with its parse error under the extra key `error`."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [_wire_tool_call(c, i) for c, i in zip(reply.tool_calls, call_ids)]
    finish = "length" if finish_reason == "length" else "tool_calls" if reply.tool_calls else "stop"
    return {"id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}]}


def _wire_tool_call(call: ToolCall, call_id: str) -> dict[str, Any]:
    out: dict[str, Any] = {"id": call_id, "type": "function",
                           "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
    if call.error is not None:
        out["error"] = call.error
    return out


def error_response(status: int, message: str, kind: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return web.json_response(body, status=status, headers={"x-should-retry": "false"})


# -- the server -----------------------------------------------------------------------------------

Handler = Callable[[dict[str, Any]], Coroutine[Any, Any, dict[str, Any]]]


@dataclass(frozen=True)
class _Episode:
    handler: Handler  # runs on `loop`: the request body in, the completion out (or ProxyError)
    loop: asyncio.AbstractEventLoop
    deadline_s: float


class Proxy:
    """The running server: `url`, and the episodes it serves (`register` / `unregister`, thread-safe)."""

    def __init__(self, url: str):
        self.url = url
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()

    def register(self, key: str, handler: Handler, loop: asyncio.AbstractEventLoop, deadline_s: float) -> str:
        """Serve episode `key`: its requests run `handler` on `loop`; returns its base URL."""
        with self._lock:
            if key in self._episodes:
                raise ValueError(f"episode key {key!r} is already registered")
            self._episodes[key] = _Episode(handler, loop, deadline_s)
        return f"{self.url}/episodes/{key}/v1"

    def unregister(self, key: str) -> None:
        with self._lock:
            self._episodes.pop(key, None)

    def lookup(self, key: str) -> _Episode:
        with self._lock:
            episode = self._episodes.get(key)
        if episode is None:
            raise ProxyError(404, f"no open episode {key!r} on this proxy: a base URL is valid while its episode "
                                  "runs", "not_found_error")
        return episode

    async def chat(self, request: web.Request) -> web.Response:
        episode = self.lookup(request.match_info["key"])
        try:
            body = await request.json()
        except ValueError:
            raise ProxyError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ProxyError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        try:
            done = asyncio.run_coroutine_threadsafe(episode.handler(body), episode.loop)
        except RuntimeError:  # its loop is closed: the episode ended without unregistering
            raise ProxyError(410, f"episode {request.match_info['key']!r} is over", "episode_over") from None
        try:
            return web.json_response(await asyncio.wait_for(asyncio.wrap_future(done), episode.deadline_s))
        except TimeoutError:
            raise ProxyError(504, f"no reply within {episode.deadline_s:g} s (the episode's request_timeout_s)",
                             "timeout") from None

    async def models(self, request: web.Request) -> web.Response:
        self.lookup(request.match_info["key"])
        return web.json_response({"object": "list",
                                  "data": [{"id": "policy", "object": "model", "owned_by": "agent-rl"}]})


@web.middleware
async def _errors(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Every failure leaves as OpenAI error JSON with one line."""
    try:
        return await handler(request)
    except ProxyError as e:
        return error_response(e.status, e.message, e.kind)
    except web.HTTPNotFound:
        return error_response(404, f"unknown endpoint {request.path}; use /episodes/<key>/v1/chat/completions",
                              "not_found_error")
    except web.HTTPException as e:
        return error_response(e.status, f"{e.status} {e.reason} on {request.method} {request.path}",
                              "invalid_request_error")
    except Exception as e:  # an episode handler's bug: the agent reads it, the server goes on
        return error_response(500, f"the proxy failed: {type(e).__name__}: {e}", "server_error")


async def _start() -> Proxy:
    proxy = Proxy("")
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/episodes/{key}/v1/chat/completions", proxy.chat)
    app.router.add_get("/episodes/{key}/v1/models", proxy.models)
    runner = web.AppRunner(app, access_log=None)
    await asyncio.wait_for(runner.setup(), 30)
    await asyncio.wait_for(web.TCPSite(runner, "127.0.0.1", 0).start(), 30)
    host, port = runner.addresses[0][:2]
    proxy.url = f"http://{host}:{port}"
    return proxy


_SERVICE = ProcessService("the agent proxy", _start)


def local_proxy(timeout_s: float = START_DEADLINE_S) -> Proxy:
    """This process's proxy server, started on the first call (blocking up to `timeout_s`)."""
    return _SERVICE.get(timeout_s)
