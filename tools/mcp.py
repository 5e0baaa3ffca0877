"""MCP servers' tools as agent-rl tools, through the official `mcp` Python SDK (2.x).

Owns: `MCPServerSpec` / `mcp_server` (a server given as a stdio command or a streamable-HTTP URL),
`MCPConnection` (one live client session: start, tool listing, calls, close, each under a
deadline), `MCPTool` (one listed tool with the interface of `tools.base.Tool`: `name`, `schema`
from the server's `inputSchema`, `timeout_s`, `async call(arguments) -> ToolResult`), the
process-wide pool of shared connections, and `MCPStartError`.
Does not own: translating schemas, arguments and results (`tools.mcp_schema`), environments
(`envs.mcp_env.MCPEnv`), tool-call parsing, prompts, servers.

Where connections live: every connection is held open by a task on one event loop of its own, on a
daemon thread ("mcp-client"), and callers reach it with `asyncio.run_coroutine_threadsafe`. The
SDK's client is a stack of anyio context managers that must be entered and left in the same task;
one process plays many event loops (each `asyncio.run` of the CLI, the trainer, a test session)
and 32-64 episodes at once, and a connection must not care which of them opens, uses or closes it.

Shared or per episode: `shared_connection(spec)` gives every episode of the process one connection
per server (started by the first episode that asks, reused by the rest; one session multiplexes
concurrent calls). Servers started one per episode cost several times one shared start, each mostly CPU
(Python and the SDK import) taken from vLLM and the trainer, while a call on the shared connection is cheap
(bench/mcp_connections.py; figures in docs/performance.md#the-bench-scripts). `connect(spec)`
opens a connection for one caller instead: use it (`MCPEnv(shared=False)`) when the server keeps
state per session, e.g. a sandbox or a browser.

Failures, each one line: a server that does not start or answer its handshake within
`start_timeout_s` raises `MCPStartError` naming the server, with the last line of its stderr.
During an episode nothing raises: an error result (`isError`) becomes an error `ToolResult` with the
server's text; a call past `tool_timeout_s` becomes "did not finish within"; arguments that do
not fit the listed JSON schema are refused before the call; a server that dies (crash, kill,
closed connection) answers that call and every later call on that connection with an error naming
it. A shared connection that died is replaced by a fresh start for the next episode that asks;
episodes already holding it keep getting error messages (no reconnect mid-episode: the server's
state is gone). Closing is bounded too: the SDK closes a stdio server's stdin, then kills its
process group after a grace period.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import os
import shlex
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agent_rl.tools.base import ToolResult
from agent_rl.tools.mcp_schema import ArgumentCheck, clean_schema, error, one_line, to_tool_result

CLOSE_TIMEOUT_S = 10.0  # the SDK's stdio shutdown takes at most ~6.5 s (stdin EOF, SIGTERM, SIGKILL)
# (asyncio.wait_for raises the builtin TimeoutError: Python >= 3.11)


class MCPStartError(RuntimeError):
    """A server that could not be started or did not complete its handshake; the message is one line."""


@dataclass(frozen=True)
class MCPServerSpec:
    """Where an MCP server is and how long to wait for it. Exactly one of `command` and `url`."""

    name: str  # used in every error message
    command: tuple[str, ...] = ()  # stdio: the executable and its arguments
    url: str | None = None  # streamable HTTP: e.g. http://127.0.0.1:8000/mcp
    env: tuple[tuple[str, str], ...] = ()  # stdio: extra environment (the SDK passes only HOME, PATH, ...)
    cwd: str | None = None  # stdio: working directory
    tools: tuple[str, ...] = ()  # expose only these tools (all when empty)
    start_timeout_s: float = 30.0  # process start + initialize handshake + tool listing
    tool_timeout_s: float = 30.0  # deadline of one tool call

    def __post_init__(self) -> None:
        if bool(self.command) == bool(self.url):
            raise ValueError(f"MCP server {self.name!r}: give exactly one of a command (stdio) and a URL (HTTP)")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"MCP server {self.name!r}: URL must start with http:// or https://, got {self.url!r}")

    def describe(self) -> str:
        return f"MCP server {self.name!r} ({self.url or shlex.join(self.command)})"


def mcp_server(target: str | Sequence[str] | MCPServerSpec, name: str | None = None, **options: Any) -> MCPServerSpec:
    """A spec from a URL (streamable HTTP), a command list or a command line (stdio).

    `options` are the other `MCPServerSpec` fields; `env` may be a dict. The default name is the
    URL's host:port or the script's file name without its suffix.
    """
    if isinstance(target, MCPServerSpec):
        return target
    if isinstance(options.get("env"), dict):
        options["env"] = tuple(sorted(options["env"].items()))
    if "tools" in options:
        options["tools"] = tuple(options["tools"])
    if isinstance(target, str) and target.startswith(("http://", "https://")):
        return MCPServerSpec(name=name or target.split("//", 1)[1].split("/", 1)[0], url=target, **options)
    command = tuple(shlex.split(target) if isinstance(target, str) else (str(part) for part in target))
    if not command:
        raise ValueError("MCP server: empty command")
    script = next((part for part in command[1:] if not part.startswith("-")), command[0])
    return MCPServerSpec(name=name or os.path.splitext(os.path.basename(script))[0], command=command, **options)


class MCPTool:
    """One tool of one MCP server, usable wherever a `tools.base.Tool` is (`tools.base.ToolLike`)."""

    def __init__(self, connection: MCPConnection, listed: Any):
        self.connection = connection
        self.name: str = listed.name
        self.description: str = inspect.cleandoc(listed.description or "")  # docstrings keep their indent
        self.timeout_s = connection.spec.tool_timeout_s
        self.parameters = clean_schema(listed.input_schema)
        self._check = ArgumentCheck(self.name, self.parameters)

    @property
    def schema(self) -> dict[str, Any]:
        """OpenAI-style function schema, as put in the system prompt."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    async def call(self, arguments: Any) -> ToolResult:
        """Check the arguments, then call through the connection; every failure is a `ToolResult`."""
        problem = self._check.problem(arguments)
        if problem:
            return error(problem)
        try:
            return await _run_on_mcp_loop(self.connection._call(self.name, arguments, self.timeout_s),
                                          self.timeout_s + 5.0)
        except TimeoutError:
            return error(f"{self.name} did not finish within {self.timeout_s:g} s")


class MCPConnection:
    """One client session to one server. Open with `connect` or `shared_connection`."""

    def __init__(self, spec: MCPServerSpec):
        self.spec = spec
        self.tools: list[MCPTool] = []
        self.dead: str | None = None  # why calls can no longer reach the server
        self._client: Any = None
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stderr: _StderrTail | None = None

    @property
    def alive(self) -> bool:
        return self.dead is None and self._client is not None

    async def aclose(self) -> None:
        """Stop the session (and a stdio server's process) within `CLOSE_TIMEOUT_S` plus a margin."""
        try:
            await _run_on_mcp_loop(self._close(), 2 * CLOSE_TIMEOUT_S + 5.0)
        except TimeoutError:
            pass  # _close gave up on the holder task itself; nothing left to wait for

    # -- below: runs on the MCP loop -----------------------------------------------------------------
    async def _open(self) -> MCPConnection:
        started = asyncio.get_running_loop().create_future()
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._hold(started), name=f"mcp:{self.spec.name}")
        try:
            await asyncio.wait_for(asyncio.shield(started), self.spec.start_timeout_s)
        except BaseException as e:
            await self._close()
            if isinstance(e, asyncio.CancelledError):
                raise
            timed_out = isinstance(e, TimeoutError)
            reason = f"no handshake within {self.spec.start_timeout_s:g} s" if timed_out else one_line(e)
            raise MCPStartError(f"{self.spec.describe()} did not start: {reason}{self._stderr_tail()}") from None
        return self

    async def _hold(self, started: asyncio.Future) -> None:
        """Enter the SDK client, list the tools, then keep the session open until `_close`."""
        try:
            from mcp import Client

            async with Client(self._transport(), mode="legacy") as client:
                if self._stderr is not None:
                    self._stderr.release_writer()  # the server has its copy: EOF now means it exited
                listed = await _list_tools(client)
                missing = set(self.spec.tools) - {t.name for t in listed}
                if missing:
                    raise ValueError(f"it has no tool named {', '.join(sorted(missing))}")
                self.tools = [MCPTool(self, t) for t in listed if not self.spec.tools or t.name in self.spec.tools]
                self._client = client
                started.set_result(None)
                assert self._stop is not None  # made before the task that runs this
                await self._stop.wait()
        except Exception as e:
            if not started.done():
                started.set_exception(e)
            self.dead = self.dead or f"the connection failed: {one_line(e)}"
        finally:
            self.dead = self.dead or "the connection is closed"
            if self._stderr is not None:
                self._stderr.close()

    def _transport(self) -> Any:
        """What the SDK's `Client` connects to: the URL, or a stdio transport with stderr to our pipe."""
        if self.spec.url:
            return self.spec.url
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client

        self._stderr = _StderrTail()
        params = StdioServerParameters(command=self.spec.command[0], args=list(self.spec.command[1:]),
                                       env=dict(self.spec.env) or None, cwd=self.spec.cwd)
        return stdio_client(params, errlog=self._stderr.writer)

    def _stderr_tail(self) -> str:
        line = self._stderr.last_line() if self._stderr is not None else ""
        return f"; its stderr ends: {line}" if line else ""

    async def _call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> ToolResult:
        if not self.alive:
            return error(f"MCP server {self.spec.name!r} is not running ({self.dead}); {name} was not called")
        import pydantic
        from mcp import MCPError
        from mcp.types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        try:
            result = await asyncio.wait_for(
                self._client.call_tool(name, arguments, read_timeout_seconds=timeout_s), timeout_s + 1.0)
        except TimeoutError:
            return error(f"{name} did not finish within {timeout_s:g} s")
        except MCPError as e:  # the SDK's own codes; any other code is the server's JSON-RPC error
            if e.code == REQUEST_TIMEOUT:
                return error(f"{name} did not finish within {timeout_s:g} s")
            if e.code == CONNECTION_CLOSED and e.error.message == "Connection closed":
                return self._died(name, e)
            return error(f"{name} failed on MCP server {self.spec.name!r}: {one_line(e)}")
        except pydantic.ValidationError as e:
            return error(f"MCP server {self.spec.name!r} sent a malformed result for {name}: {one_line(e)}")
        except Exception as e:  # transport errors: the HTTP server went away, a broken pipe
            return self._died(name, e)
        return to_tool_result(name, result)

    def _died(self, name: str, e: BaseException) -> ToolResult:
        self.dead = self.dead or f"it closed the connection during {name}: {one_line(e)}{self._stderr_tail()}"
        return error(f"MCP server {self.spec.name!r} stopped during {name} ({one_line(e)}){self._stderr_tail()}")

    async def _close(self) -> None:
        if self._task is not None and not self._task.done():
            if self._client is None:
                self._task.cancel()  # still starting (a server that never answers): stop the start
            elif self._stop is not None:
                self._stop.set()
            done, _ = await asyncio.wait({self._task}, timeout=CLOSE_TIMEOUT_S)
            if not done:
                self._task.cancel()
                await asyncio.wait({self._task}, timeout=CLOSE_TIMEOUT_S)
        self.dead = self.dead or "the connection is closed"
        self._client = None
        if self._stderr is not None:
            self._stderr.close()


class _StderrTail:
    """A stdio server's stderr: a pipe read on the MCP loop; the last 4 KB are kept for error messages."""

    KEEP = 4096

    def __init__(self) -> None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        self.fd: int | None = read_fd
        self.writer: Any = os.fdopen(write_fd, "w")  # handed to the server process as its stderr
        self.data = bytearray()
        asyncio.get_running_loop().add_reader(read_fd, self.read)

    def read(self) -> None:
        while self.fd is not None:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                return
            if not chunk:  # every writer closed: the server exited
                asyncio.get_running_loop().remove_reader(self.fd)
                return
            self.data += chunk
            del self.data[:-self.KEEP]

    def last_line(self) -> str:
        lines = [ln.strip() for ln in self.data.decode("utf-8", "replace").splitlines() if ln.strip()]
        return lines[-1][:300] if lines else ""

    def release_writer(self) -> None:
        if not self.writer.closed:
            self.writer.close()

    def close(self) -> None:
        self.release_writer()
        if self.fd is not None:
            self.read()  # what the server wrote last
            asyncio.get_running_loop().remove_reader(self.fd)
            os.close(self.fd)
            self.fd = None


async def connect(spec: MCPServerSpec | str | Sequence[str]) -> MCPConnection:
    """A new connection for one caller (close it with `aclose`); `MCPStartError` if it does not start."""
    spec = mcp_server(spec)
    return await _run_on_mcp_loop(MCPConnection(spec)._open(), spec.start_timeout_s + 2 * CLOSE_TIMEOUT_S + 5.0)


async def shared_connection(spec: MCPServerSpec | str | Sequence[str]) -> MCPConnection:
    """This process's connection to `spec`: started on first use, replaced once it died."""
    spec = mcp_server(spec)
    return await _run_on_mcp_loop(_pooled(spec), spec.start_timeout_s + 4 * CLOSE_TIMEOUT_S + 5.0)


_pool: dict[MCPServerSpec, asyncio.Future] = {}  # touched only on the MCP loop


async def _pooled(spec: MCPServerSpec) -> MCPConnection:
    opening = _pool.get(spec)
    stale = None if opening is None or not opening.done() or opening.cancelled() or opening.exception() \
        else opening.result()
    if opening is None or (opening.done() and (stale is None or not stale.alive)):
        # first use, a failed start or a dead server: start afresh (in the pool before any await)
        opening = _pool[spec] = asyncio.ensure_future(MCPConnection(spec)._open())
        if stale is not None:
            await stale._close()
    return await asyncio.shield(opening)  # episodes waiting on one start share it and its outcome


def close_shared(timeout_s: float = 2 * CLOSE_TIMEOUT_S + 5.0) -> None:
    """Close every shared connection (stdio servers stop). Called at exit; safe to call any time."""
    if _loop is None or not _pool:
        return

    async def close_all() -> None:
        openings = list(_pool.values())
        _pool.clear()
        conns = [f.result() for f in openings if f.done() and not f.cancelled() and not f.exception()]
        starting = [f for f in openings if not f.done()]
        for f in starting:
            f.cancel()  # _open closes what it started
        await asyncio.gather(*starting, *(c._close() for c in conns), return_exceptions=True)

    try:
        asyncio.run_coroutine_threadsafe(close_all(), _loop).result(timeout_s)
    except Exception:  # a stuck close: stdio servers still get EOF on stdin when this process exits
        pass


atexit.register(close_shared)

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _mcp_loop() -> asyncio.AbstractEventLoop:
    """The event loop every MCP connection lives on, running on a daemon thread."""
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="mcp-client", daemon=True).start()
            _loop = loop
    return _loop


async def _run_on_mcp_loop(coro: Any, timeout_s: float) -> Any:
    """Run `coro` on the MCP loop and await it here; cancelling or timing out here cancels it there."""
    future = asyncio.run_coroutine_threadsafe(coro, _mcp_loop())
    return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)


async def _list_tools(client: Any) -> list[Any]:
    tools, cursor = [], None
    for _ in range(100):  # a paginator that never ends cannot hang the start
        page = await client.list_tools(cursor=cursor)
        tools += page.tools
        cursor = page.next_cursor
        if cursor is None:
            break
    return tools
