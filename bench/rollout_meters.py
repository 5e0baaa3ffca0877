"""What bench/rollout.py reads while a side runs: requests in flight over time (`InFlight`, counted around a
sampler by `Counted`), the server's own counters (`counters`, the serving backend's) and a side's steady window
(`Window`: the server's generated tokens and the requests in flight between two events of the side).
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from agent_rl.rollout.serving.choose import serving_backend


class InFlight:
    """Requests in flight over time: `mean` is their average number since `start`."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.n, self.area, self.requests = 0, 0.0, 0

    def add(self, d: int) -> None:
        now = time.perf_counter()
        self.area += self.n * (now - self.last)
        self.n, self.last, self.requests = self.n + d, now, self.requests + (d > 0)

    @property
    def mean(self) -> float:
        self.add(0)
        return self.area / max(self.last - self.start, 1e-9)


class Counted:
    """A sampler whose requests in flight an `InFlight` counts."""

    def __init__(self, inner, meter: InFlight):
        self.inner, self.meter, self.policy_version = inner, meter, inner.policy_version

    async def sample(self, prompt_ids, params, messages=()):
        self.meter.add(1)
        try:
            return await self.inner.sample(prompt_ids, params, messages)
        finally:
            self.meter.add(-1)


class Window:
    """A side's steady state: the server's own count of generated tokens (vLLM's `generation_tokens` counter) and
    the requests in flight, read when event number `opens_at` and `closes_at` happen (episodes admitted, or
    requests done). Tokens/s and mean batch between the two; None when the side never gets there (`closes_at`
    <= `opens_at`: fewer episodes than the stream holds at once)."""

    def __init__(self, url: str, meter: InFlight, opens_at: int, closes_at: int):
        self.url, self.meter, self.opens_at, self.closes_at = url, meter, opens_at, closes_at
        self.reads: dict[int, asyncio.Task] = {}

    def at(self, event: int) -> None:
        if self.opens_at < self.closes_at and event in (self.opens_at, self.closes_at):
            self.meter.add(0)
            self.reads[event] = asyncio.ensure_future(self._read(self.meter.last, self.meter.area))

    async def _read(self, t: float, area: float) -> tuple[float, float, float, float]:
        """(the read's mid time, generated tokens so far, requests-in-flight area at t, t)"""
        tokens = (await counters(self.url, "generation_tokens"))["generation_tokens"]
        return (t + time.perf_counter()) / 2, tokens, area, t

    async def result(self) -> tuple[float, float] | None:
        """(generated tokens/s, mean requests in flight) over the window."""
        if len(self.reads) < 2:
            return None
        (t0, n0, a0, ta0), (t1, n1, a1, ta1) = await self.reads[self.opens_at], await self.reads[self.closes_at]
        return (n1 - n0) / (t1 - t0), (a1 - a0) / (ta1 - ta0)


async def counters(url: str, *names: str) -> dict[str, float]:
    """The server's counters `names` (tokens, `ServingBackend.counters`), summed over engines."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        read = await serving_backend().counters(http, url)
    return {name: read[name] for name in names}
