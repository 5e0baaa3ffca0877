"""Deadlines for awaits on the rollout's hot path: thousands at once, one loop timer per slice of time.

Owns: `deadline(timeout_s)`, an async context manager that, like `asyncio.timeout`, cancels the task that
entered it once `timeout_s` has passed and turns that cancellation into TimeoutError on the way out; `Alarm`, a
callback at a deadline, for code that keeps its own state rather than a task waiting (the tool worker pool's
calls), in the same slices.
Does not own: what is awaited, nor what a timeout means to the caller (the runner's `bounded`, a tool
worker's call).

Why not `asyncio.timeout`: it puts a timer of its own in the event loop's heap for every await (and cancels it
after), and with thousands of episodes in flight that heap holds thousands of timers, so each push costs a dozen
of `TimerHandle.__lt__`'s Python-level comparisons. A rollout makes two or three such awaits a turn (the env
step, the tool's worker call), each finishing long before its deadline: with 4,096 tasks in flight, several times
the CPU a deadline here costs (bench/deadlines.py; figures in docs/performance.md#the-bench-scripts). Here a
deadline joins the set of deadlines that fall in the same slice of time, and one timer per slice fires them all;
leaving the context takes it out of its set.

The price is precision: a deadline fires at the end of its slice, up to 1/32 of `timeout_s` late and at most a
second (a 120 s deadline fires between 120 and 121 s), never early. Slices are powers of two of a second,
so deadlines of similar length share them.
"""

from __future__ import annotations

import asyncio
import math
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

_FINEST = 2.0**-10  # ~1 ms: the shortest slice
_COARSEST = 1.0  # the longest: a deadline is at most a second late

# event loop -> {(slice length, slice index): the deadlines and alarms that end in it}; weak, so a closed loop
# takes its (by then empty) sets with it
_SLICES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[float, int], set[Any]]] = (
    weakref.WeakKeyDictionary())


def slice_length(timeout_s: float) -> float:
    """The slice a deadline of `timeout_s` falls in: the largest power of two at most timeout_s / 32, within
    [~1 ms, 1 s]."""
    if not timeout_s > _FINEST * 32:
        return _FINEST
    return min(_COARSEST, 2.0 ** math.floor(math.log2(timeout_s / 32)))


class Deadline:
    """`async with deadline(s):` (module doc). The states are asyncio.Timeout's: its task's cancellations counted
    on entry; on the way out, a cancellation that this deadline made (and no one else's since) becomes
    TimeoutError."""

    __slots__ = ("timeout_s", "expired", "_task", "_cancelling", "_slice")

    def __init__(self, timeout_s: float | None):
        self.timeout_s = timeout_s
        self.expired = False  # it fired: its task was cancelled by it
        self._task: asyncio.Task | None = None
        self._cancelling = 0
        self._slice: set[Deadline] | None = None

    async def __aenter__(self) -> Deadline:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("deadline() must be entered inside a task")
        if self._task is not None:
            raise RuntimeError("a deadline is entered once")
        self._task, self._cancelling = task, task.cancelling()
        if self.timeout_s is not None and not math.isinf(self.timeout_s):
            self._slice = _join(task.get_loop(), self)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._slice is not None:
            self._slice.discard(self)
            self._slice = None
        if self.expired and self._task is not None and self._task.uncancel() <= self._cancelling \
                and exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            raise TimeoutError from exc

    def _fire(self) -> None:
        self._slice = None
        if self._task is not None and not self._task.done():
            self.expired = True
            self._task.cancel()


class Alarm:
    """`callback()` once `timeout_s` has passed on `loop` (up to a slice late, as a deadline), unless `cancel`led
    first; None or inf: never."""

    __slots__ = ("timeout_s", "_callback", "_slice")

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float | None, callback: Callable[[], Any]):
        self.timeout_s, self._callback = timeout_s, callback
        self._slice: set[Any] | None = None
        if timeout_s is not None and not math.isinf(timeout_s):
            self._slice = _join(loop, self)

    def cancel(self) -> None:
        if self._slice is not None:
            self._slice.discard(self)
            self._slice = None

    def _fire(self) -> None:
        if self._slice is not None:
            self._slice = None
            self._callback()


def deadline(timeout_s: float | None) -> Deadline:
    """TimeoutError in the awaiting task once `timeout_s` has passed (None or inf: never); module doc."""
    return Deadline(timeout_s)


def _join(loop: asyncio.AbstractEventLoop, d: Deadline | Alarm) -> set[Any]:
    """Add `d` to the set of its slice, made (with the timer that fires it) if it is the slice's first."""
    assert d.timeout_s is not None
    slices = _SLICES.get(loop)
    if slices is None:
        slices = _SLICES[loop] = {}
    length = slice_length(d.timeout_s)
    key = (length, math.ceil((loop.time() + max(0.0, d.timeout_s)) / length))  # NaN or < 0: at once
    members = slices.get(key)
    if members is None:
        members = slices[key] = set()
        loop.call_at(key[1] * length, _fire_slice, slices, key)
    members.add(d)
    return members


def _fire_slice(slices: dict[tuple[float, int], set[Any]], key: tuple[float, int]) -> None:
    for d in list(slices.pop(key, ())):  # a copy: an alarm's callback may cancel another alarm of the slice
        d._fire()
