"""Where a synchronous tool runs, with a deadline that holds: a stoppable thread or a killable process.

Owns: `run_in_thread` (one thread per call, stopped at the deadline by `ToolOverrun` raised inside
it); which functions a worker process can run (`function_address`, `resolve`).
Does not own: the worker processes (`tools.worker_pool`: a pool per event loop, killed at a call's
deadline; the worker's side is `tools.worker`, the messages on their pipes `tools.worker_pool`'s), which
runner a tool uses, argument validation, or the tool message (`tools.base`).

Why two runners. A thread shares the interpreter with the event loop. Pure-Python code in it lets
the loop run (the GIL changes hands every 5 ms) and is stopped at its deadline: `ToolOverrun` is
raised inside the thread (CPython's `PyThreadState_SetAsyncExc`) and ends it at its next bytecode,
so it cannot keep a core busy after its deadline. What no thread can escape is one long C call that
holds the GIL, such as Python's big-int `**`: it stops every thread, the event loop included, and no
exception reaches it before it returns (nor can a blocking call such as `time.sleep` be cut short).
A worker process is a separate interpreter: the event loop keeps running whatever the tool does,
and at the deadline the worker is killed (SIGKILL). It costs a process per pool slot (started on
first use) and a pipe round trip per call (`bench/tool_call.py`, the calculator in a worker against a thread:
docs/performance.md#the-bench-scripts), and the function must be importable by name (a
module-level function), because the worker imports it: bound methods of environments, whose state
lives here, cannot go there. So a tool opts in (`tools.base.tool_options(isolate=True)`) when its
cost is the model's to choose: the calculator, whose arithmetic is bounded as well, so that a hole
in that bound would cost one call its deadline, not the run. Other synchronous tools run in a thread.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


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


# ---- what a worker process can run ---------------------------------------------------------

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
