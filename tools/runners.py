"""Where a synchronous tool runs, with a deadline that holds: a stoppable thread or a killable process.

Owns: `run_in_thread` (one thread per call, stopped at the deadline by `ToolOverrun` raised inside
it), `run_in_worker` (warm worker processes, a pool per event loop; a call that overruns kills its
worker and a fresh one takes its place later; an idle pool holds no reference to its loop, so a
finished loop takes its workers with it); the messages on their pipes are `tools.pipes`, the
worker's side is `tools.worker`.
Does not own: which runner a tool uses, argument validation, or the tool message (`tools.base`).

Why two runners. A thread shares the interpreter with the event loop. Pure-Python code in it lets
the loop run (the GIL changes hands every 5 ms) and is stopped at its deadline: `ToolOverrun` is
raised inside the thread (CPython's `PyThreadState_SetAsyncExc`) and ends it at its next bytecode,
so it cannot keep a core busy after its deadline. What no thread can escape is one long C call that
holds the GIL, such as Python's big-int `**`: it stops every thread, the event loop included, and no
exception reaches it before it returns (nor can a blocking call such as `time.sleep` be cut short).
A worker process is a separate interpreter: the event loop keeps running whatever the tool does,
and at the deadline the worker is killed (SIGKILL). It costs a process per pool slot (~26 MiB, started
on first use in 0.1-0.3 s) and a pipe round trip per call (`bench/tool_call.py`, the calculator: p50
0.18 ms in a worker against 0.09 ms in a thread), and the function must be importable by name (a
module-level function), because the worker imports it: bound methods of environments, whose state
lives here, cannot go there. So a tool opts in (`tools.base.tool_options(isolate=True)`) when its
cost is the model's to choose: the calculator, whose arithmetic is bounded as well, so that a hole
in that bound would cost one call its deadline, not the run. Other synchronous tools run in a thread.

The wait for a free worker does not count against a call's deadline; the call itself does.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import importlib
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from agent_rl.core.deadline import deadline
from agent_rl.tools.pipes import frame, pipe_size, write_all

log = logging.getLogger(__name__)
POOL_SIZE = max(2, min(4, os.cpu_count() or 2))  # concurrent isolated calls per event loop
START_TIMEOUT_S = 120.0  # a worker's start-up and the import of a tool's module (not the call's deadline)
_BOOT = "import json, sys; sys.path[:] = json.loads(sys.argv[1]); from agent_rl.tools.worker import serve; serve()"


class ToolOverrun(BaseException):
    """Raised inside a synchronous tool's thread once its deadline has passed, to stop it.

    A BaseException, so that a tool's own `except Exception` does not swallow it."""


def _in_thread(fn: Callable[..., Any], *args: Any, name: str = "tool") -> tuple[asyncio.Future, threading.Thread]:
    """Run `fn(*args)` in a new daemon thread; its outcome lands in the returned future (unless cancelled)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def deliver(value: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_result(value) if error is None else future.set_exception(error)

    def body() -> None:
        outcome: tuple[Any, BaseException | None]
        try:
            outcome = fn(*args), None
        except BaseException as e:  # delivered to the caller, which decides what it means
            outcome = None, e
        try:
            loop.call_soon_threadsafe(deliver, *outcome)
        except RuntimeError:  # the loop has closed: nobody waits for this any more
            pass

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    return future, thread


def _set_async_exc(ident: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in thread `ident` at its next bytecode; None withdraws one not raised yet."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc) if exc else None)


class _StoppableCall:
    """One call of a sync function in its own thread that `stop()` ends by raising `ToolOverrun` in it.

    A stop is raised at most once and only while the function still runs (both under `_lock`); the
    thread withdraws a stop that arrived too late to be raised inside the function."""

    def __init__(self, fn: Callable[..., Any], kwargs: dict[str, Any], name: str):
        self._fn, self._kwargs = fn, kwargs
        self._lock = threading.Lock()
        self._done = self._stopped = False
        self.future, self.thread = _in_thread(self._body, name=f"tool {name}")

    def _body(self) -> Any:
        try:
            value, error = self._fn(**self._kwargs), None
        except BaseException as e:  # ToolOverrun included: raised at the call's next bytecode
            value, error = None, e
        while True:
            try:
                self._finish()
                break
            except ToolOverrun:  # the stop surfaced only after the function had returned
                continue
        if error is not None:
            raise error
        return value

    def _finish(self) -> None:
        with self._lock:
            self._done = True
            if self._stopped and self.thread.ident is not None:
                _set_async_exc(self.thread.ident, None)

    def stop(self) -> None:
        with self._lock:
            if self._done or self._stopped or self.thread.ident is None:
                return
            self._stopped = True
            _set_async_exc(self.thread.ident, ToolOverrun)


async def run_in_thread(fn: Callable[..., Any], kwargs: dict[str, Any], timeout_s: float, name: str) -> Any:
    """`fn(**kwargs)` in a thread of its own; at `timeout_s` (or on cancellation) the thread is
    stopped and TimeoutError raised. A thread still running a second later is logged: it is inside
    a C call, and its tool should run in a worker process."""
    call = _StoppableCall(fn, kwargs, name)
    try:
        return await asyncio.wait_for(call.future, timeout_s)
    finally:
        if not call.future.done() or call.future.cancelled():
            call.stop()
            asyncio.get_running_loop().call_later(1.0, _warn_if_alive, call.thread, name, timeout_s)


def _warn_if_alive(thread: threading.Thread, name: str, timeout_s: float) -> None:
    if thread.is_alive():
        log.warning("tool %s still runs 1 s after its %g s deadline, inside one C call that cannot be "
                    "stopped: run it in a worker process (tool_options(isolate=True))", name, timeout_s)


# ---- worker processes ------------------------------------------------------------------------

def function_address(fn: Callable[..., Any]) -> tuple[str, str]:
    """(module, qualname) under which a worker imports `fn`; TypeError if it cannot."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    try:
        found = module not in (None, "__main__") and "<" not in qualname and resolve(module, qualname) is fn
    except (ImportError, AttributeError, TypeError):
        found = False
    if not found or module is None:
        raise TypeError(f"{getattr(fn, '__name__', fn)!r} cannot run in a worker process: it must be a "
                        f"module-level function of an importable module (not __main__, a lambda, a closure "
                        f"or a bound method), because the worker imports it by name")
    return module, qualname


def resolve(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class _Worker:
    """One warm worker process and its pipes, serving one request at a time. The request is written
    straight to the worker's stdin when the pipe holds it whole (the worker is idle and has read every
    earlier request, so the write does not wait); a larger one is written from a thread. The reply is
    read by the event loop, which watches the worker's stdout from its first call until it is
    killed or closes the pipe, not by a thread per call (a thread's start and its hand-back to the loop
    cost more than the call: bench/tool_call.py). The worker refers to that loop weakly, so an idle pool
    still holds no reference to its loop."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, json.dumps([str(p) for p in sys.path])],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.loaded: set[tuple[str, str]] = set()
        assert self.proc.stdout is not None  # stdout=PIPE
        self._out = self.proc.stdout.fileno()
        os.set_blocking(self._out, False)  # our end only: the worker's reads and writes still block
        self._received = bytearray()
        self._reply: asyncio.Future[tuple[str, Any]] | None = None  # the call waiting for its reply
        self._watcher: weakref.ref[asyncio.AbstractEventLoop] | None = None  # the loop reading stdout
        self.ended = False  # stdout reached its end: the worker exited
        self._fits = pipe_size(self.proc.stdin)  # a request this small is written at once: the worker
        # has read every earlier one, so the pipe is empty and takes it whole

    async def ask(self, message: tuple, timeout_s: float) -> tuple[str, Any]:
        """The reply to `message`; EOFError if the worker closes its pipe, TimeoutError past `timeout_s`."""
        if self.ended:
            raise EOFError("the worker process closed its pipe")
        loop = asyncio.get_running_loop()
        if self._watcher is None:
            loop.add_reader(self._out, self._read)
            self._watcher = weakref.ref(loop)
        self._reply = reply = loop.create_future()
        data = frame(message)
        try:
            async with deadline(timeout_s):
                if len(data) <= self._fits:
                    write_all(self.proc.stdin, data)
                else:  # a larger one waits for the worker to read it: never on the loop
                    await asyncio.to_thread(write_all, self.proc.stdin, data)
                return await reply
        finally:
            self._reply = None

    def _read(self) -> None:
        """What the worker wrote so far; the waiting call gets the message once its length-prefixed bytes
        are all here. A worker with no call waiting has nothing to say but its end (it is then killed)."""
        try:
            chunk = os.read(self._out, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        reply = self._reply if self._reply is not None and not self._reply.done() else None
        if not chunk:
            self.ended = True
            self._unwatch()
            if reply is not None:
                reply.set_exception(EOFError("the worker process closed its pipe"))
            return
        self._received += chunk
        size = int.from_bytes(self._received[:4], "big") if len(self._received) >= 4 else -1
        if 0 <= size <= len(self._received) - 4:
            data = bytes(self._received[4:4 + size])
            del self._received[:4 + size]
            if reply is not None:
                reply.set_result(pickle.loads(data))

    def _unwatch(self) -> None:
        """The loop stops reading stdout: before the pipe closes, so that no reader of a closed fd is left."""
        loop = None if self._watcher is None else self._watcher()
        self._watcher = None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._out)

    def kill(self) -> None:
        self._unwatch()
        if self.proc.poll() is None:
            self.proc.kill()
        try:  # reap it without blocking the loop
            threading.Thread(target=self.proc.wait, daemon=True).start()
        except RuntimeError:  # no new threads at interpreter shutdown: nothing left to reap it for
            pass
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass


def _kill_all(workers: set[_Worker]) -> None:
    for w in list(workers):
        w.kill()


class _Slots:
    """asyncio.Semaphore without its binding to a loop: an idle pool holds no reference to its loop,
    so a finished loop (and with it the pool, which then kills its workers) can be collected."""

    def __init__(self, size: int):
        self._free = size
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    async def acquire(self) -> None:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        granted = asyncio.get_running_loop().create_future()
        self._waiters.append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.release()  # handed a slot just as it was cancelled: pass it on
            elif granted in self._waiters:
                self._waiters.remove(granted)
            raise

    def release(self) -> None:
        while self._waiters:
            granted = self._waiters.popleft()
            if not granted.done():
                granted.set_result(None)
                return
        self._free += 1


class WorkerPool:
    """Up to `size` warm worker processes serving the isolated tool calls of one event loop."""

    def __init__(self, size: int = POOL_SIZE):
        self._slots = _Slots(size)
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        weakref.finalize(self, _kill_all, self._all)  # also at interpreter exit

    async def call(self, address: tuple[str, str], kwargs: dict[str, Any], timeout_s: float) -> tuple[str, Any]:
        """The worker's reply ("ok", content) / ("refused", ToolError text) / ("failed", "Type: text");
        TimeoutError past `timeout_s`, RuntimeError if the worker does not start or dies."""
        await self._slots.acquire()
        try:
            return await self._serve(self._take(), address, kwargs, timeout_s)
        finally:
            self._slots.release()

    async def _serve(self, worker: _Worker, address: tuple[str, str], kwargs: dict[str, Any],
                     timeout_s: float) -> tuple[str, Any]:
        healthy = False
        try:
            if address not in worker.loaded:  # start-up and import, outside the call's deadline
                reply = await self._ask(worker, ("load", *address), START_TIMEOUT_S, "start")
                if reply[0] != "ok":
                    healthy = True
                    return reply
                worker.loaded.add(address)
            reply = await self._ask(worker, ("call", *address, kwargs), timeout_s, "call")
            healthy = True
            return reply
        finally:
            if healthy:
                self._idle.append(worker)
            else:  # overran, died or was cancelled mid-call: its state is unknown
                worker.kill()
                self._all.discard(worker)

    def _take(self) -> _Worker:
        """An idle worker that is still alive, or a new one."""
        while self._idle:
            worker = self._idle.pop()
            if worker.proc.poll() is None and not worker.ended:
                return worker
            worker.kill()
            self._all.discard(worker)
        return self._start()

    def _start(self) -> _Worker:
        worker = _Worker()
        self._all.add(worker)
        return worker

    @staticmethod
    async def _ask(worker: _Worker, message: tuple, timeout_s: float, what: str) -> tuple[str, Any]:
        try:
            return await worker.ask(message, timeout_s)
        except (EOFError, BrokenPipeError):
            try:  # it closed its pipe: it is exiting, or already gone
                code: int | str = await asyncio.wait_for(asyncio.to_thread(worker.proc.wait), 2.0)
            except TimeoutError:
                code = "unknown"
            raise RuntimeError(f"the worker process exited (status {code}) during the {what}") from None
        except TimeoutError:
            if what == "call":
                raise
            raise RuntimeError(f"the worker process did not start within {START_TIMEOUT_S:g} s") from None


_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, WorkerPool] = weakref.WeakKeyDictionary()


async def run_in_worker(address: tuple[str, str], kwargs: dict[str, Any], timeout_s: float) -> tuple[str, Any]:
    """Call the function at `address` in a worker process of this event loop's pool (`WorkerPool.call`)."""
    loop = asyncio.get_running_loop()
    if loop not in _POOLS:
        _POOLS[loop] = WorkerPool()
    return await _POOLS[loop].call(address, kwargs, timeout_s)
