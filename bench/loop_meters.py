"""What a benchmark reads from its own process while it runs: the event loop's lag (`LagMeter`), garbage
collections (`CollectionTimes`), page faults (`page_faults`) and the time its thread waited for a CPU
(`run_queue_s`).

Owns: those meters. Does not own: what is measured with them (bench/runner_scale.py, bench/runner_workers.py).
"""

from __future__ import annotations

import asyncio
import resource
import time
from pathlib import Path


class CollectionTimes:
    """A `gc.callbacks` hook: when each garbage collection started (loop clock) and how long it took."""

    def __init__(self):
        self.times: list[tuple[float, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.monotonic()
        else:
            self.times.append((self._start, time.monotonic() - self._start))

    def longest(self, since: float, until: float) -> float:
        return max((d for t, d in self.times if since <= t < until), default=0.0)


class LagMeter:
    """How late a task that asks to wake every `period` s wakes: the event loop's lag."""

    def __init__(self, period: float = 0.01):
        self.period, self.lags = period, []

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.period)
            self.lags.append(loop.time() - t - self.period)


def page_faults() -> int:
    """The process's page faults so far (minor: a page first touched, or mapped again after it was given back)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def run_queue_s() -> float:
    """Seconds the event loop's thread has waited for a CPU (Linux schedstat): how loaded the machine is."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0
