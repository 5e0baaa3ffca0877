"""A simulated clock for asyncio: an event loop whose time jumps to the next timer whenever nothing else
is ready, so that hours of simulated GPU time run in the minutes of CPU the Python code needs.

Owns: `SimClockLoop` (an asyncio event loop on a simulated clock) and `run` (asyncio.run on one).
Does not own: what is simulated (`sim_servers`, bench/async_sim.py).

Everything that waits on the loop's clock waits in simulated time: `asyncio.sleep`, `wait_for`
deadlines, `call_at` (the simulated servers' completions), `loop.time()`. The CPU time of the Python code
itself takes no simulated time: a figure measured on this clock leaves out the client's own cost
(bench/runner_scale.py measures that one on the real clock). Work handed to the loop's executor
(`run_in_executor`, `asyncio.to_thread`) freezes the clock until it is done, as if it took no time.
Nothing else outside the loop is waited for: a thread of one's own, a subprocess or a socket answers
after the clock has jumped to the next timer (a deadline, say). Simulate with async code only.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any


class _Selector(selectors.DefaultSelector):
    """The real selector, except that a wait with nothing ready and no thread at work moves the clock."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: SimClockLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        loop = self.loop
        if ready or timeout == 0 or loop is None:
            return ready
        if timeout is None or loop.threads:  # nothing scheduled, or a thread will wake us: a real wait
            return super().select(timeout if timeout is None else min(timeout, 1.0))
        loop.now += timeout
        return []


class SimClockLoop(asyncio.SelectorEventLoop):
    """An event loop on a simulated clock (module doc)."""

    def __init__(self) -> None:
        selector = _Selector()
        super().__init__(selector)
        selector.loop = self
        self.now = 0.0
        self.threads = 0  # executor jobs not yet done

    def time(self) -> float:
        return self.now

    def run_in_executor(self, executor: Any, func: Any, *args: Any) -> asyncio.Future[Any]:
        self.threads += 1
        future = super().run_in_executor(executor, func, *args)
        future.add_done_callback(self._thread_done)
        return future

    def _thread_done(self, _future: asyncio.Future[Any]) -> None:
        self.threads -= 1


def run(main: Coroutine[Any, Any, Any]) -> Any:
    """`asyncio.run(main)` on a simulated clock."""
    with asyncio.Runner(loop_factory=SimClockLoop) as runner:
        return runner.run(main)
