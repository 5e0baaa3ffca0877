"""What every weight sync shares: the protocol the trainer calls, the calls to the servers, the version folders.

Owns: `WeightSync` (the protocol: `push(model, version)` at any moment, episodes in flight or not; `restore(url)`
for a server back in service; `finish()` at the end of a run), `WeightSyncError` and `Gone`, `Servers` (the serving
backend's calls to every server of a sampler that is up, with a deadline, each error naming the server and quoting
its reply; a server that went down in the middle skipped, as its restore will bring it the weights; the lock that
keeps a push and a restore apart; `reload_in_place`, the one place the push protocol of weights reloaded in place is
written: hold the sampler, pause with abort, reload, reset the prefix cache, sweep, resume, release), and the
version folders on disk (`write_version_dir`, `prune_version_dirs`).
Does not own: what a version is (`adapter`, `full`, `merged`), which sync a run uses (`choose`),
the sampler and how it goes on from an aborted request (`rollout.sampler`), which servers are up and
restarting them (`rollout.supervisor`), the routes each call takes (`rollout.serving`).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import aiohttp

from agent_rl.core.files import atomic_dir
from agent_rl.rollout.sampler import ServerGate
from agent_rl.rollout.serving.base import ServerCallError
from agent_rl.rollout.serving.choose import serving_backend

T = TypeVar("T")


class WeightSyncError(Exception):
    """A server did not take the new weights; the message names the server and quotes its reply."""


class Gone(WeightSyncError):
    """The server went down during the call (its gate says so): a push goes on without it, and its restart
    restores the weights the others then serve (`WeightSync.restore`)."""


class WeightSync(Protocol):
    """Makes every server sample from the trainer's policy. Versions increase: a version is the number of
    optimizer steps its weights have taken, and the sampler tags each sampled token with the version that
    sampled it. A push may come at any moment while episodes are in flight: a request in flight finishes
    on its own version (an adapter stays loaded) or is aborted and goes on under the new one (weights
    reloaded in place: `Servers.reload_in_place`); no token is tagged with a version that did not sample it."""

    async def push(self, model: Any, version: int) -> float:
        """Publish `model` (a peft model, a full model, or weights gathered whole) as `version` on every
        server and point the sampler at it; returns the seconds it took."""
        ...

    async def restore(self, url: str) -> None:
        """The server at `url` is back (restarted, or an attached one that answers again) and takes no request
        yet: give it what the others serve, the current version and those requests may still name, under their
        own names (`rollout.supervisor` calls it; never at the same time as a push)."""
        ...

    async def finish(self) -> None:
        """The run is over: leave the servers as a later user expects them (a no-op where nothing is to
        restore). Called once, also after the run failed."""
        ...


class Held(Protocol):
    """What a reload in place needs of the sampler whose requests it interrupts (`rollout.sampler.ServedSampler`)."""

    def hold(self) -> None: ...

    def release(self) -> None: ...

    def in_flight(self, url: str | None = None, model: str | None = None) -> int: ...


_VERSION_DIR = re.compile(r"^v(\d+)$")


def write_version_dir(parent: Path, version: int, write: Callable[[Path], object]) -> Path:
    """`write(folder)` into `parent/v{version}`, atomically (`core.files.atomic_dir`): a version folder
    exists only once complete; one of the same version (a resumed run writing it again) is replaced."""
    final = parent / f"v{version}"
    with atomic_dir(final) as tmp:
        write(tmp)
    return final


def prune_version_dirs(parent: Path, keep_versions: set[int]) -> None:
    """Delete every `v{n}` folder not in `keep_versions` (older versions, or a crashed run's)."""
    if not parent.is_dir():
        return
    for path in parent.iterdir():
        m = _VERSION_DIR.match(path.name)
        if m and int(m.group(1)) not in keep_versions:
            shutil.rmtree(path, ignore_errors=True)


def _nothing() -> None:
    pass


class Servers:
    """The servers a sync talks to, through the run's serving backend (`rollout.serving`): every call has a deadline;
    every error names the server and quotes its reply. With a gate (`rollout.supervisor`), calls go to the servers
    that are up, and a server that goes down during one is left out of it (`Gone`): its restart restores what the
    others serve, under `lock`, which a push holds too, so a restore reads the weights of a finished push."""

    def __init__(self, urls: Sequence[str], timeout_s: float, connect_timeout_s: float, gate: ServerGate | None = None):
        self.urls = list(urls)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self.gate = gate
        self.lock = asyncio.Lock()
        self.backend = serving_backend()

    def session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(timeout=self.timeout)

    def live(self) -> list[str]:
        """The servers that take calls now: all of them, without a gate."""
        return [u for u in self.urls if self.gate is None or self.gate.is_up(u)]

    async def call(self, url: str, work: Awaitable[T]) -> T:
        """`work`, a call of the backend's to the server at `url`; its failure a WeightSyncError, or `Gone` when the
        server gave no answer and the gate says it is down (a refusal came from a server alive enough to answer)."""
        try:
            return await work
        except ServerCallError as e:
            gone = not e.answered and self.gate is not None and await self.gate.lost(url)
            raise (Gone if gone else WeightSyncError)(str(e)) from None

    async def on_all(self, work: Callable[[str], Awaitable[None]], urls: Sequence[str] | None = None) -> None:
        """`work(url)` on every server that is up (or on `urls`), concurrently; the first failure is raised, a server
        gone in the middle (`Gone`) left out."""
        results = await asyncio.gather(*(self.call(url, work(url)) for url in (self.live() if urls is None else urls)),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, Gone):
                raise r

    async def adapters(self, http: aiohttp.ClientSession, url: str) -> set[str]:
        """The names of the LoRA adapters the server at `url` holds."""
        return set(await self.call(url, self.backend.adapters(http, url)))

    async def reload_in_place(self, folder: Path, switch: Callable[[], None] = _nothing,
                              sampler: Held | None = None) -> dict[str, float]:
        """Every server replaces its weights with those in `folder` (servers that can reload in place: vLLM's in dev
        mode), while `sampler`'s episodes may be in flight; each step a call of the backend's to every server:
          1. `sampler.hold()`: its new requests wait, so none is sent under the version being replaced;
          2. `pause` with abort: every request in flight ends at once with the tokens it has sampled
             (finish_reason "abort"); the sampler keeps them, tagged with the old version, and will go on
             from them under the new one (`VLLMSampler.sample`). Requests that reach a paused server wait;
          3. `load_weights` from `folder`, which also drops the prefix cache: KV blocks computed with the old
             weights must not be reused;
          4. the sweep: a request of the sampler's still unanswered reached its server after the pause and
             waits there; `abort_requests` ends it (no tokens yet) before it could run on the new
             weights under the old version's tag, until the sampler has nothing in flight;
          5. `switch()` (the sampler onto the new version), `resume`, `sampler.release()`.
        Why abort and go on rather than wait for requests in flight: a wait lasts as long as the longest
        turn in flight (thousands of tokens on a long-tailed agent task, while every server idles more and
        more); the abort costs one prefill of each interrupted request, which the reset cache needs anyway.
        Without a sampler (`finish`: no episodes) the same calls, with no hold and no sweep.
        A failure resumes every server and releases the sampler (never left paused), and is raised; the
        first one is reported. Returns the seconds of each phase: `drain_s` (the pause), `reload_s` (reload,
        reset and sweep), `resume_s`."""
        backend = self.backend
        if sampler is not None:
            sampler.hold()
        try:
            async with self.session() as http:
                t0 = time.perf_counter()
                try:
                    await self.on_all(lambda url: backend.pause(http, url))
                    t1 = time.perf_counter()
                    await self.on_all(lambda url: backend.load_weights(http, url, folder))
                    if sampler is not None:
                        await self._sweep(http, sampler)
                    switch()
                except BaseException:
                    with contextlib.suppress(WeightSyncError):
                        await asyncio.shield(self.on_all(lambda url: backend.resume(http, url)))
                    raise
                t2 = time.perf_counter()
                await self.on_all(lambda url: backend.resume(http, url))
        finally:
            if sampler is not None:
                sampler.release()
        return {"drain_s": t1 - t0, "reload_s": t2 - t1, "resume_s": time.perf_counter() - t2}

    async def _sweep(self, http: aiohttp.ClientSession, sampler: Held, every_s: float = 0.05) -> None:
        """Abort, on each paused server, the sampler's requests that reached it after the pause, until none is
        in flight; within the servers' deadline (`WeightSyncError` past it)."""
        deadline = time.monotonic() + (self.timeout.total or 60.0)
        while waiting := [url for url in self.live() if sampler.in_flight(url)]:
            if time.monotonic() > deadline:
                raise WeightSyncError(f"server {waiting[0]} still holds {sampler.in_flight(waiting[0])} "
                                      f"request(s) after pausing and aborting them")
            await self.on_all(lambda url: self.backend.abort_requests(http, url), urls=waiting)
            await asyncio.sleep(every_s)
