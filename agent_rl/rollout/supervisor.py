"""Server supervision: the run's vLLM servers watched, restarted when they die, given the current weights before
they take a request again.

Owns: `Supervisor`, the `ServerGate` the sampler and the weight sync ask which servers take requests: the watch
of every server (its process exited; no healthy answer for `sampler.health_timeout_s`), the restart of a
server the run started (its whole process group stopped, the same command on the same port, then the weight
sync's `restore`, and only then up again), the restart budget (`sampler.max_restarts` per server), the bounded
wait for a server attached by URL (`sampler.attach_wait_s`; when it answers again it is restored the same way),
the one line past either (`failure`, handed to `on_failure`), the counts (`fault/restarts`, `fault/reattached`,
`fault/down_s`), and which servers are down as rollout workers mirror it (`state`, `listen`).
Does not own: the server process, its command and its health probe (`rollout.serving`), routing requests and
ending the one whose server died (`rollout.sampler`: `ServerLost`), replaying its episode (`rollout.stream`), what
the current weights are (`rollout.weight_sync`: `restore`), what the run does once a server cannot be mended (`trainer`:
it stops as on a signal, the last completed step checkpointed).

Supervision begins with `start`, once the run's first weights are on the servers: before it, a server that dies
is an error as it always was (`lost` says no), since there is nothing yet to restore it to. Every wait has a
deadline: a health probe `probe_timeout_s`, a restart the server's `startup_timeout_s`, a stop its own
(`ServerProcess.stop`), the wait for an attached server `attach_wait_s`, a request's wait for a server
`sampler.request_timeout_s` (`wait_up`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from agent_rl.core.config import SamplerConfig
from agent_rl.rollout.remote_gate import GateState
from agent_rl.rollout.sampler import SamplerError
from agent_rl.rollout.serving.base import ServerError, ServerProcess
from agent_rl.rollout.serving.choose import serving_backend
from agent_rl.rollout.weight_sync.base import WeightSyncError

log = logging.getLogger(__name__)

Probe = Callable[[str, float], Awaitable[bool]]  # (url, timeout_s) -> whether the server answered healthy in time
Restore = Callable[[str], Awaitable[None]]  # the weight sync's `restore`


def exit_status(process: ServerProcess) -> int | None:
    """The process's exit status once it has ended (a SIGKILL: -9), None while it runs."""
    return None if process.proc is None else process.proc.poll()


@dataclass(eq=False)
class _Server:
    url: str
    process: ServerProcess | None  # None: attached by URL
    up: bool = True
    gone: bool = False  # given up on: the run stops
    restarts: int = 0  # launches after the first
    seen: float = 0.0  # loop time of the last healthy answer
    down_since: float = 0.0
    counted: float = 0.0  # loop time up to which its down time went into `fault/down_s`
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class Supervisor:
    """Watches the run's servers and mends what it can (module doc).

        async with Supervisor(urls, servers, max_restarts=3, health_timeout_s=60, attach_wait_s=300) as sup:
            sup.bind(sampler)                         # the sampler routes by `is_up`, waits in `wait_up`
            ... push the first weights ...
            sup.start(sync.restore, on_failure)       # from here on a server that dies is mended
            sup.metrics()                             # each step: restarts since the last call

    `processes`: the servers the run started, one per URL in order (restarted); None: attached by URL (waited for).
    """

    def __init__(self, urls: Sequence[str], processes: Sequence[ServerProcess] | None, *, max_restarts: int,
                 health_timeout_s: float, attach_wait_s: float, poll_s: float = 1.0, probe_timeout_s: float = 10.0,
                 probe: Probe | None = None):
        if processes is not None and len(processes) != len(urls):
            raise ValueError(f"{len(processes)} server processes for {len(urls)} URLs")
        self.servers = [_Server(u.rstrip("/"), None if processes is None else processes[i]) for i, u in enumerate(urls)]
        self.by_url = {s.url: s for s in self.servers}
        self.max_restarts, self.health_timeout_s, self.attach_wait_s = max_restarts, health_timeout_s, attach_wait_s
        self.poll_s, self.probe_timeout_s = poll_s, min(probe_timeout_s, health_timeout_s)
        self._probe = probe
        self.backend = serving_backend()  # its `health` probes the servers (unless `probe` is given)
        self._http: aiohttp.ClientSession | None = None
        self._restore: Restore | None = None
        self.on_failure: Callable[[Exception], None] = lambda error: None
        self.failure: ServerError | None = None  # the line the run ends with, once a server cannot be mended
        self.counts: defaultdict[str, float] = defaultdict(float)  # since the last `metrics()`
        self._changed = asyncio.Event()  # replaced at each change: every waiter of the old one wakes
        self._listeners: list[Callable[[], None]] = []  # told of each change (`listen`)
        self._tasks: set[asyncio.Future[Any]] = set()  # the watch, restarts and waits: cancelled on exit
        self._stops: set[asyncio.Future[Any]] = set()  # stops in their threads: waited for on exit, never cancelled

    @classmethod
    def from_config(cls, cfg: SamplerConfig, urls: Sequence[str], processes: Sequence[ServerProcess] | None
                    ) -> Supervisor:
        return cls(urls, processes, max_restarts=cfg.max_restarts, health_timeout_s=cfg.health_timeout_s,
                   attach_wait_s=cfg.attach_wait_s)

    async def __aenter__(self) -> Supervisor:
        self._http = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Cancel the watch, restarts and waits, and let the stops already under way finish (each has its deadline):
        the caller stops every server next, and no restart may launch one after that."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *self._stops, return_exceptions=True)
        if self._http is not None:
            await self._http.close()

    def bind(self, sampler: Any) -> None:
        """Make `sampler` (a served sampler) route by this supervisor: its requests go to the servers that are up."""
        sampler.gate = self

    def start(self, restore: Restore, on_failure: Callable[[Exception], None]) -> None:
        """Supervision begins: a server that dies from now on is brought back and given `restore(url)` before it
        takes a request; `on_failure(error)` once one cannot be (past the budget, or an attached one past its wait)."""
        self._restore, self.on_failure = restore, on_failure
        now = _now()
        for s in self.servers:
            s.seen = now
        self._spawn(self._watch())

    # -- the gate (rollout.sampler.ServerGate) ------------------------------------------------------------------

    def is_up(self, url: str) -> bool:
        s = self.by_url.get(url.rstrip("/"))
        return s is None or s.up

    async def wait_up(self, timeout_s: float) -> None:
        """Until some server is up; SamplerError past `timeout_s`, or at once when the run is stopping (`failure`)."""
        deadline = _now() + timeout_s
        while not any(s.up for s in self.servers):
            if self.failure is not None:
                raise SamplerError(str(self.failure))
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), max(0.0, deadline - _now()))
            except TimeoutError:
                raise SamplerError(f"no vLLM server was up within {timeout_s:g} s (sampler.request_timeout_s); "
                                   f"down: {', '.join(s.url for s in self.servers)}") from None

    async def lost(self, url: str) -> bool:
        """A call to `url` failed at the connection: whether its server is down, which then begins its mending.
        A started server is down once its process has ended (a killed one has closed its sockets as it dies, so
        the exit shows within moments); an attached one once its health probe does not answer."""
        s = self.by_url.get(url.rstrip("/"))
        if s is None or self._restore is None:
            return False  # not supervised (yet): the caller's error stands
        if not s.up:
            return True
        if s.process is not None:
            deadline = _now() + 2.0
            while (code := exit_status(s.process)) is None and _now() < deadline:
                await asyncio.sleep(0.05)
            if code is None:
                return False  # alive: the failure was the call's own (retried as ever; a hang is the watch's)
            self._down(s, f"exited with status {code}")
            return True
        if await self.probe(s.url, self.probe_timeout_s):
            return False
        self._down(s, "stopped answering")
        return True

    def state(self) -> GateState:
        """Which servers are down now, and the line the run stops with once one cannot be mended: what the rollout
        workers' gates mirror (`rollout.remote_gate`)."""
        return GateState(tuple(s.url for s in self.servers), frozenset(s.url for s in self.servers if not s.up),
                         "" if self.failure is None else str(self.failure))

    def listen(self, changed: Callable[[], None]) -> Callable[[], None]:
        """`changed()` at each change of `state()` (a server down, back, or given up on), as it happens: a server
        back is restored before; returns the call that stops it."""
        self._listeners.append(changed)

        def stop() -> None:
            if changed in self._listeners:
                self._listeners.remove(changed)
        return stop

    # -- watching and mending -----------------------------------------------------------------------------------

    async def probe(self, url: str, timeout_s: float) -> bool:
        if self._probe is not None:
            return await self._probe(url, timeout_s)
        assert self._http is not None, "a Supervisor is used inside `async with`"
        return await self.backend.health(self._http, url, timeout_s)

    async def _watch(self) -> None:
        while True:
            await asyncio.gather(*(self._check(s) for s in self.servers if s.up))
            await asyncio.sleep(self.poll_s)

    async def _check(self, s: _Server) -> None:
        if s.process is not None and (code := exit_status(s.process)) is not None:
            self._down(s, f"exited with status {code}")
        elif await self.probe(s.url, self.probe_timeout_s):
            s.seen = _now()
        elif _now() - s.seen > self.health_timeout_s:
            self._down(s, f"did not answer its health probe for {self.health_timeout_s:g} s (sampler.health_timeout_s)")

    def _down(self, s: _Server, why: str) -> None:
        if not s.up or s.gone:
            return
        s.up, s.down_since = False, _now()
        self._notify()
        s.task = self._spawn(self._restart(s, why) if s.process is not None else self._reattach(s, why))

    async def _restart(self, s: _Server, why: str) -> None:
        """Stop what is left of the server, start it again (same command, same port), restore the weights; a
        failed attempt is tried again while the budget lasts."""
        assert s.process is not None and self._restore is not None
        while s.restarts < self.max_restarts:
            s.restarts += 1
            self.counts["fault/restarts"] += 1  # each launch, as the budget counts them
            log.warning("vLLM server %s %s: restarting it (restart %d of at most %d, sampler.max_restarts)",
                        s.url, why, s.restarts, self.max_restarts)
            try:
                await self._stop(s.process)  # the whole group: a killed leader leaves its engine processes
                _keep_log(s.process, s.restarts)
                s.process.launch()
                await self._started(s.process)
                await self._restore(s.url)
            except (ServerError, WeightSyncError) as e:
                why = f"failed to restart ({e})"
                continue
            return self._up(s)
        await self._give_up(s, f"vLLM server {s.url} {why}; restarted {s.restarts} time(s) already "
                               f"(sampler.max_restarts: {self.max_restarts})")

    async def _started(self, process: ServerProcess) -> None:
        """Until the launched server answers its health probe, within its start-up deadline (ServerError past it)."""
        deadline = _now() + process.startup_timeout_s
        while not await self.probe(process.url, 2.0):
            if (code := exit_status(process)) is not None:
                raise ServerError(f"it exited with status {code} during start-up; log {process.log_path} ends "
                                  f"with: {process.log_tail()}")
            if _now() > deadline:
                raise ServerError(f"it did not answer its health probe within {process.startup_timeout_s:g} s")
            await asyncio.sleep(0.5)

    async def _reattach(self, s: _Server, why: str) -> None:
        """Wait for an attached server to answer again (someone else restarts it), then restore it."""
        assert self._restore is not None
        log.warning("vLLM server %s %s: waiting up to %g s for it (sampler.attach_wait_s)", s.url, why,
                    self.attach_wait_s)
        deadline = _now() + self.attach_wait_s
        while _now() < deadline:
            if await self.probe(s.url, min(self.probe_timeout_s, max(0.1, deadline - _now()))):
                try:
                    await self._restore(s.url)
                except WeightSyncError:
                    pass  # healthy, not yet loading: try again
                else:
                    return self._up(s)
            await asyncio.sleep(self.poll_s)
        await self._give_up(s, f"vLLM server {s.url} {why} and did not answer again within {self.attach_wait_s:g} s "
                               f"(sampler.attach_wait_s)")

    def _up(self, s: _Server) -> None:
        s.up, s.seen = True, _now()
        if s.process is None:
            self.counts["fault/reattached"] += 1
        self._count_down(s, s.seen)
        log.warning("vLLM server %s is back, %.0f s after it went down", s.url, s.seen - s.down_since)
        self._notify()

    async def _give_up(self, s: _Server, line: str) -> None:
        """The run stops (`on_failure`, at once) and nothing of the server is left behind."""
        s.gone = True
        self.failure = ServerError(line)
        self._notify()
        self.on_failure(self.failure)
        if s.process is not None:
            await self._stop(s.process)

    async def _stop(self, process: ServerProcess) -> None:
        """`process.stop()` in a thread (it waits for the group to end, within its deadlines); shielded, and waited
        for on exit, so that a cancelled restart never races the caller's own stop of the same server."""
        await asyncio.shield(self._spawn(asyncio.to_thread(process.stop), self._stops))

    def _spawn(self, work: Awaitable[Any], into: set[asyncio.Future[Any]] | None = None) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(work)
        tasks = self._tasks if into is None else into
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        for changed in list(self._listeners):
            changed()

    def _count_down(self, s: _Server, until: float) -> None:
        """`s`'s down time not yet counted, up to `until`, into `fault/down_s`."""
        self.counts["fault/down_s"] += until - max(s.down_since, s.counted)
        s.counted = until

    def metrics(self) -> dict[str, float]:
        """Since the last call: restarts (`fault/restarts`, each launch, a failed one included), attached servers
        that answered again (`fault/reattached`), and the seconds servers were down (`fault/down_s`; a server still
        down counts up to this call, the rest of its outage goes to the next)."""
        now = _now()
        for s in self.servers:
            if not s.up:
                self._count_down(s, now)
        out = {k: float(self.counts[k]) for k in ("fault/restarts", "fault/reattached", "fault/down_s")}
        self.counts.clear()
        return out


def _keep_log(process: ServerProcess, restart: int) -> None:
    """The log of the server that died, kept beside the new one's (`vllm-0.log` -> `vllm-0.before-restart-1.log`)."""
    path = process.log_path
    if path is not None and Path(path).is_file():
        Path(path).replace(Path(path).with_name(f"{Path(path).stem}.before-restart-{restart}{Path(path).suffix}"))


def _now() -> float:
    return asyncio.get_running_loop().time()
