"""The plumbing every small HTTP service here shares: request parameters, JSON errors, start and stop.

Owns: `RequestError` (a 4xx/5xx with a message written for the caller), `request_params` (validated
GET query or POST JSON parameters), `json_errors` (middleware: a deadline on every request, every
failure as `{"error": ...}`), `Service` (a running app's URL and its clean close) and `serve`, and
`ProcessService` (a service a process starts once, on first use, in a thread of its own).
Does not own: any endpoint (`tools.kg_service`, `tools.search_service`).
"""

from __future__ import annotations

import asyncio
import queue
import re
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from aiohttp import web


class RequestError(Exception):
    """A request a service cannot answer; `status` is the HTTP status, `message` says how to recover."""

    def __init__(self, status: int, message: str, **extra: Any):
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


async def request_params(request: web.Request, endpoint: str, spec: dict[str, tuple[type, bool]], *,
                         max_chars: int = 200, max_int: int = 100) -> dict[str, Any]:
    """Validated parameters from the query string (GET) or a JSON object body (POST); 400 with a reason."""
    if request.method == "POST":
        try:
            raw = await request.json()
        except ValueError:
            raise RequestError(400, f"/{endpoint}: the body is not valid JSON") from None
        if not isinstance(raw, dict):
            raise RequestError(400, f"/{endpoint}: the body must be a JSON object, got {type(raw).__name__}")
    else:
        raw = dict(request.query)
    expected = ", ".join(f"{p}{'' if req else '?'}" for p, (_, req) in spec.items())
    if unknown := sorted(set(raw) - set(spec)):
        raise RequestError(400, f"/{endpoint}: unknown parameter {unknown[0]!r}; expected: {expected}")
    out: dict[str, Any] = {}
    for name, (kind, required) in spec.items():
        value = raw.get(name)
        if value is None or value == "":
            if required:
                raise RequestError(400, f"/{endpoint}: missing parameter {name!r}; expected: {expected}")
            continue
        if kind is int and isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
            value = int(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise RequestError(400, f"/{endpoint}: parameter {name!r} must be {kind.__name__}, got {value!r}"[:300])
        if isinstance(value, str) and len(value) > max_chars:
            raise RequestError(400, f"/{endpoint}: parameter {name!r} is longer than {max_chars} characters")
        if isinstance(value, int) and not 1 <= value <= max_int:
            raise RequestError(400, f"/{endpoint}: parameter {name!r} must be from 1 to {max_int}, got {value}")
        out[name] = value
    return out


def json_errors(endpoints: str, deadline_s: float = 10.0) -> Callable:
    """Middleware: a deadline on every request; every failure leaves as `{"error": ...}` JSON, 4xx/5xx."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            async with asyncio.timeout(deadline_s):
                return await handler(request)
        except RequestError as e:
            return web.json_response({"error": e.message, **e.extra}, status=e.status)
        except web.HTTPNotFound:
            return web.json_response({"error": f"unknown endpoint {request.path}; endpoints: {endpoints}"}, status=404)
        except web.HTTPMethodNotAllowed:
            msg = f"method {request.method} not allowed on {request.path}; use GET or POST"
            return web.json_response({"error": msg}, status=405)
        except web.HTTPException as e:
            return web.json_response({"error": f"{e.status} {e.reason}: {e.text or ''}".strip()}, status=e.status)
        except TimeoutError:
            return web.json_response({"error": f"{request.path} took longer than {deadline_s:g} s"}, status=503)

    return middleware


class Service:
    """A running aiohttp app on a TCP port: `.url`, `await close()`, or `async with`."""

    def __init__(self, runner: web.AppRunner, url: str, on_close: Callable[[], None]):
        self.runner, self.url, self._on_close = runner, url, on_close

    async def close(self) -> None:
        await asyncio.wait_for(self.runner.cleanup(), 30)
        self._on_close()

    async def __aenter__(self) -> Service:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def serve(app: web.Application, host: str, port: int, on_close: Callable[[], None]) -> Service:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5)
    await asyncio.wait_for(runner.setup(), 30)
    try:
        await asyncio.wait_for(web.TCPSite(runner, host, port).start(), 30)
    except BaseException:
        await asyncio.wait_for(runner.cleanup(), 30)
        on_close()
        raise
    bound_host, bound_port = runner.addresses[0][:2]
    host = f"[{bound_host}]" if ":" in bound_host else bound_host
    return Service(runner, f"http://{host}:{bound_port}", on_close)


T = TypeVar("T")


class ProcessService(Generic[T]):
    """A service this process starts once, on its first use, in a daemon thread with an event loop of its
    own, and serves until the process exits (the knowledge graph of `envs.kg_qa`, the agent proxy).

    `start` is awaited on that loop and returns what callers get (it keeps its own deadlines); nothing
    is closed at exit (an atexit clean-up would find the thread pools it needs already shut down)."""

    def __init__(self, what: str, start: Callable[[], Awaitable[T]]):
        self.what, self._start = what, start
        self._lock = threading.Lock()
        self._value: T | None = None

    def get(self, timeout_s: float) -> T:
        """The service, started on the first call (blocking up to `timeout_s`); a start that fails or
        overruns is a RuntimeError naming the service."""
        with self._lock:
            if self._value is None:
                started: queue.Queue[Any] = queue.Queue(maxsize=1)
                threading.Thread(target=asyncio.run, args=(self._serve(started),), name=self.what, daemon=True).start()
                try:
                    result = started.get(timeout=timeout_s)
                except queue.Empty:
                    raise RuntimeError(f"{self.what} did not start within {timeout_s:g} s") from None
                if isinstance(result, BaseException):
                    raise RuntimeError(f"{self.what} could not start: {result}") from result
                self._value = result
        return self._value

    async def _serve(self, started: queue.Queue) -> None:
        try:
            value = await self._start()
        except Exception as e:
            started.put(e)
            return
        started.put(value)
        await asyncio.Event().wait()  # no deadline on purpose: it serves until the process exits
