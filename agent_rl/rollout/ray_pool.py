"""Rollout workers on Ray, seen from rank 0: the pool of workers, and the sampler a weight sync talks to.

Owns: `WorkerPool` (the `rollout.players.Players` of a run on Ray: N `rollout.worker.RolloutWorker` actors with the
`ray` section's resources and restarts; each episode given to the worker with the fewest in flight among those up,
the episodes sent in batches and their trajectories collected in batches; a worker's death makes the episodes it
held infrastructure errors, and its restart is waited for aside); `control`, one call on every worker that is up,
waited for (what `rollout.workers.PooledSampler` makes of a new policy, a hold, a release, and the counts a push
reads), and `tell`, one not waited for (a server down or back); the answers to the workers' gates' questions
(`_answer`: is a server whose call failed down? rank 0's gate says, `rollout.remote_gate`).
Does not own: the cluster (`rollout.ray_connect`), a worker's body and what it plays with (`rollout.worker`), the
sampler a run and its weight sync see (`rollout.workers`), an episode (`rollout.runner`), which episodes play
when (`rollout.stream`), pushes (`rollout.weight_sync`).

Batches, not a call per episode. A Ray call costs about half a millisecond of CPU on each side (measured here),
as much as a turn of the runner itself, and thousands of calls queued to one actor delay every control call
behind them. So each worker gets the episodes given to it in one event-loop turn as one `submit`, and one
long-polling `results` call per worker at a time brings back every trajectory that ended since the last
(`RolloutWorker.results`, at most one answer every 5 ms).

Routing over the servers. Each worker's sampler sends its requests to the server with the fewest of *its own*
requests outstanding (`VLLMSampler`); no worker sees the others' load. Each worker levels its own share, so a
server's load is the sum of W levelled shares, within about W requests of even: small beside the loads where
balance matters (8,192 episodes on 64 servers is ~128 a server). One global count would cost a round trip to a
shared counter on every request.

A worker's death. Its episodes in flight end as infrastructure errors (`WorkerDied: ...`), which
`rollout.on_error` treats like any other: under `retry` (the default) each is played again from its start with
its own seeds, on a worker that is up, so the step trains what an unfaulted run trains. Ray restarts the worker
(`ray.max_restarts`); it is given episodes again once it answers, and learns the served policy from the first
batch. A worker's death shows as a failed call, or as a new process id in an answer (a call that reached the
restarted worker). Once every worker is dead for good (restarts used up) the run ends with a `WorkerError` line.

Control calls block rank 0's event loop for one round trip to each worker (a push, its hold and release, the
in-flight counts a push reads, the idle share once a step): a push must not end while a worker still sends
requests to the old policy, and the `ServedSampler` protocol the syncs call is synchronous.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

from agent_rl.core.types import Branch, Trajectory
from agent_rl.rollout.ray_connect import first_line
from agent_rl.rollout.runner import EpisodeLimits, failed_episode
from agent_rl.rollout.sampler import ServerGate
from agent_rl.rollout.worker import Kit, RolloutWorker, ServedState, Submitted, WorkerError, WorkerSettings

CONTROL_TIMEOUT_S = 30.0  # a control call to a worker that is up: past it the worker is hung, the run ends
POLL_S = 1.0  # how long one `results` call waits for an episode to end before it answers with none


@dataclass(eq=False)
class _Sent:
    """An episode given to a worker, until its trajectory comes back."""

    task: dict[str, Any]
    version: int  # the served version when it was given: a failure's trajectory is tagged with it
    done: asyncio.Future[Trajectory]
    pid: int = 0  # the worker process it was sent to (0: not sent yet)


@dataclass(eq=False)
class _Worker:
    index: int
    handle: Any  # a Ray actor handle of `RolloutWorker`
    pid: int = 0
    up: bool = True  # answering; a worker that died is not, until its restart answers
    dead: bool = False  # for good: restarts used up, or it did not come back in time
    life: int = 0  # counts its deaths: a call made before the last one cannot find it dead again
    episodes: dict[int, _Sent] = field(default_factory=dict)  # given to it and not ended, by id
    outbox: list[Submitted] = field(default_factory=list)  # not yet sent
    cancels: list[int] = field(default_factory=list)  # episodes given up on, not yet told
    mark: tuple[int, float] = (0, 0.0)  # (pid, request-seconds) at the last idle-share reading


def _cause(e: BaseException) -> str:
    """A worker's failure in one line: the exception it raised, else the first line of Ray's error."""
    raised = [x.strip() for x in str(e).splitlines() if x.strip() and not x.startswith((" ", "\t"))
              and ("Error:" in x or "Exception:" in x) and not x.startswith(("ray.exceptions", "The actor"))]
    return raised[-1] if raised else first_line(e)


class WorkerPool:
    """The rollout workers of one run, and where each episode goes."""

    def __init__(self, workers: list[_Worker], settings: WorkerSettings):
        self.workers, self.settings = workers, settings
        self.state = ServedState()  # what every episode is sent with (`PooledSampler` keeps it current)
        self.gate: ServerGate | None = None  # rank 0's (`rollout.supervisor`): it answers the workers' questions
        self.some_up = asyncio.Event()
        self.some_up.set()
        self.tasks: set[asyncio.Task[None]] = set()  # pollers, probes, sends
        self.ids = itertools.count()
        self.turn = 0  # rotates the ties between equally loaded workers
        self.last_death = ""
        self.idle_mark = time.monotonic()
        self.servers = 1  # the servers the workers sample from, for the idle share (`rollout.workers` sets it)

    @classmethod
    async def start(cls, n: int, kit: Callable[[], Kit], settings: WorkerSettings) -> WorkerPool:
        """`n` workers, each building `kit()`; returns once every one answers (`ray.start_timeout_s`)."""
        r = settings.ray
        actor = ray.remote(RolloutWorker).options(num_cpus=r.num_cpus, resources=dict(r.resources),
                                                  max_restarts=r.max_restarts, max_task_retries=0, max_concurrency=64)
        pool = cls([_Worker(i, actor.remote(kit, i)) for i in range(n)], settings)
        try:
            answers = await asyncio.wait_for(asyncio.gather(*(w.handle.ready.remote() for w in pool.workers)),
                                             r.start_timeout_s)
        except TimeoutError:
            pool.stop()
            needs = {"CPU": r.num_cpus, **r.resources}
            raise WorkerError(f"{n} rollout workers did not all start within {r.start_timeout_s:g} s "
                              f"(ray.start_timeout_s): does a node of the cluster have what each asks, {needs}? "
                              f"(`ray status` lists what the nodes have)") from None
        except RayActorError as e:
            pool.stop()
            raise WorkerError(f"a rollout worker could not start: {_cause(e)}") from None
        broken = [f"rollout worker {w.index} cannot play: {why}" for w, (_, why) in zip(pool.workers, answers) if why]
        if broken:
            pool.stop()
            raise WorkerError(broken[0])
        for w, (pid, _) in zip(pool.workers, answers):
            w.pid = pid
            pool._spawn(pool._poll(w))
        return pool

    def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for w in self.workers:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(w.handle, no_restart=True)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def deadline_s(self, limits: EpisodeLimits) -> float:
        """A backstop for one episode, far past its own deadlines (each request and environment call has one):
        only a worker that hangs without dying reaches it."""
        return (limits.max_turns + 2) * (4 * self.settings.request_timeout_s + limits.env_timeout_s)

    # -- episodes -------------------------------------------------------------------------------------------------

    async def play(self, task: dict[str, Any], index: int, limits: EpisodeLimits,
                   branch: Branch | None = None) -> Trajectory:
        """Rollout `index` of `task` on the least busy worker; an infrastructure error if the worker dies."""
        worker = await self._pick()
        eid, loop = next(self.ids), asyncio.get_running_loop()
        episode = _Sent(task, self.state.version, loop.create_future())
        worker.episodes[eid] = episode
        worker.outbox.append((eid, task, index, limits, branch))
        if len(worker.outbox) == 1:  # the episodes given in this turn of the loop go as one call
            loop.call_soon(self._flush, worker)
        try:
            return await asyncio.wait_for(asyncio.shield(episode.done), self.deadline_s(limits))
        except TimeoutError:
            return failed_episode(task, f"WorkerTimeout: rollout worker {worker.index} played it for more than "
                                        f"{self.deadline_s(limits):g} s", "WorkerTimeout", episode.version)
        finally:  # timed out, or the stream closing: the worker stops playing it
            if worker.episodes.pop(eid, None) is not None and episode.pid and worker.up:
                worker.cancels.append(eid)
                if len(worker.cancels) == 1:  # those of one turn of the loop go as one call
                    loop.call_soon(self._flush_cancels, worker)

    def _flush(self, worker: _Worker) -> None:
        batch, worker.outbox = worker.outbox, []
        live = [item for item in batch if item[0] in worker.episodes]  # not given up on meanwhile
        if live:
            self._spawn(self._send(worker, live, self.state))

    def _flush_cancels(self, worker: _Worker) -> None:
        eids, worker.cancels = worker.cancels, []
        if worker.up:
            self._spawn(self._cancel(worker, eids))

    async def _cancel(self, worker: _Worker, eids: list[int]) -> None:
        with contextlib.suppress(RayActorError):  # a worker gone plays nothing
            await worker.handle.cancel.remote(eids)

    async def _send(self, worker: _Worker, batch: list[Any], state: ServedState) -> None:
        life = worker.life
        try:
            pid = await worker.handle.submit.remote(batch, state)
        except RayActorError as e:
            self._lost(worker, e, life)
            return
        for eid, *_ in batch:
            if (episode := worker.episodes.get(eid)) is not None:
                episode.pid = pid
        if pid != worker.pid:  # the call reached a restarted worker: what the old one held is lost
            self._restarted(worker, pid)

    async def _poll(self, worker: _Worker) -> None:
        """Collect the worker's ended episodes, one long-polling call at a time, until it is found dead."""
        life = worker.life
        while True:
            try:
                pid, ended, questions = await worker.handle.results.remote(POLL_S)
            except RayActorError as e:
                self._lost(worker, e, life)
                return
            if life != worker.life:
                return  # a poller of an earlier life: the probe started the current one
            if pid != worker.pid:
                self._restarted(worker, pid)
            for eid, traj in ended:
                episode = worker.episodes.pop(eid, None)
                if episode is not None and not episode.done.done():
                    episode.done.set_result(traj)
            for url in questions:
                self._spawn(self._answer(worker, url))

    async def _answer(self, worker: _Worker, url: str) -> None:
        """A call of `worker`'s to `url` failed at the connection: whether that server is down, as rank 0's gate
        says (asking it begins the server's mending), sent back with the state after it (which says so)."""
        down = self.gate is not None and await self.gate.lost(url)
        with contextlib.suppress(RayActorError):  # a worker gone asks nothing any more
            await worker.handle.answer.remote(url, down, self.state)

    def _fail(self, worker: _Worker, why: str, lost: Callable[[_Sent], bool]) -> None:
        for eid, episode in list(worker.episodes.items()):
            if lost(episode):
                del worker.episodes[eid]
                if not episode.done.done():
                    episode.done.set_result(failed_episode(episode.task, why, "WorkerDied", episode.version))

    def _restarted(self, worker: _Worker, pid: int) -> None:
        why = f"WorkerDied: rollout worker {worker.index} (pid {worker.pid}) was restarted while playing it"
        self.last_death = why.removeprefix("WorkerDied: ")
        self._fail(worker, why, lambda e: e.pid not in (0, pid))
        worker.pid = pid

    def _lost(self, worker: _Worker, error: BaseException, life: int | None = None) -> None:
        """A call to `worker` (made in its life `life`; None: now) found it dead: what it held fails, and no episode
        goes to it until it answers again."""
        if life is not None and life != worker.life:
            return  # it died before, and has been restarted since
        self.last_death = f"rollout worker {worker.index} (pid {worker.pid}): {_cause(error)}"
        self._fail(worker, f"WorkerDied: rollout worker {worker.index} (pid {worker.pid}) stopped while playing "
                           f"it: {_cause(error)}", lambda e: True)
        worker.outbox.clear()
        if worker.up:
            worker.up, worker.life = False, worker.life + 1
            self._spawn(self._probe(worker))

    async def _pick(self) -> _Worker:
        """The worker with the fewest episodes in flight among those up; waits while none is (restarting)."""
        while not (up := [w for w in self.workers if w.up]):
            if all(w.dead for w in self.workers):
                raise WorkerError(f"every rollout worker has died for good (ray.max_restarts: "
                                  f"{self.settings.ray.max_restarts}); the last: {self.last_death}")
            self.some_up.clear()
            try:
                await asyncio.wait_for(self.some_up.wait(), self.settings.ray.start_timeout_s)
            except TimeoutError:
                raise WorkerError(f"no rollout worker came back within {self.settings.ray.start_timeout_s:g} s "
                                  f"(ray.start_timeout_s); the last death: {self.last_death}") from None
        low = min(len(w.episodes) for w in up)
        self.turn += 1
        tied = [w for w in up if len(w.episodes) == low]
        return tied[self.turn % len(tied)]

    async def _probe(self, worker: _Worker) -> None:
        deadline = time.monotonic() + self.settings.ray.start_timeout_s
        while True:
            try:
                worker.pid, broken = await asyncio.wait_for(worker.handle.ready.remote(), deadline - time.monotonic())
                if broken:  # its restart could not build what it plays with
                    raise WorkerError(broken)
                worker.up = True
                self._spawn(self._poll(worker))
                break
            except WorkerError as e:
                worker.dead = True
                self.last_death += f"; its restart cannot play: {e}"
                break
            except (ActorDiedError, TimeoutError) as e:  # restarts used up, or not back in time
                worker.dead = True
                self.last_death += f"; not restarted: {_cause(e)}"
                break
            except RayActorError:  # unavailable while it restarts: ask again
                await asyncio.sleep(0.5)
        self.some_up.set()  # wakes the episodes waiting for a worker (they see whether any is up)

    # -- control ----------------------------------------------------------------------------------------------

    def control(self, method: str, *args: Any) -> list[tuple[_Worker, Any]]:
        """`method(*args)` on every worker that is up, waited for (`CONTROL_TIMEOUT_S`): (worker, its answer),
        the answer None for a worker found dead."""
        up = [w for w in self.workers if w.up]
        refs = [getattr(w.handle, method).remote(*args) for w in up]
        out: list[tuple[_Worker, Any]] = []
        for w, ref in zip(up, refs):
            try:
                out.append((w, ray.get(ref, timeout=CONTROL_TIMEOUT_S)))
            except RayActorError as e:  # died: it has nothing in flight, and learns the state from its next batch
                self._lost(w, e)
                out.append((w, None))
            except GetTimeoutError:
                raise WorkerError(f"rollout worker {w.index} (pid {w.pid}) did not answer {method} within "
                                  f"{CONTROL_TIMEOUT_S:g} s") from None
        return out

    def tell(self, method: str, *args: Any) -> None:
        """`method(*args)` on every worker that is up, not waited for: Ray may run it after a later call, so what
        it sends must be numbered (`ServedState.seq`). A worker found dead meanwhile is lost as in `control`."""
        for w in self.workers:
            if w.up:
                self._spawn(self._told(w, getattr(w.handle, method).remote(*args), w.life))

    async def _told(self, worker: _Worker, call: Any, life: int) -> None:
        try:
            await call
        except RayActorError as e:
            self._lost(worker, e, life)

    def idle_share(self) -> float:
        """The servers' idle share since the last call, estimated from the workers' request-seconds: one minus
        the mean requests in flight per server, at least 0. A lower bound of the share a `rollout.players.RequestMeter`
        measures in one process (the same while fewer requests than servers are in flight)."""
        servers = self.servers
        now = time.monotonic()
        elapsed, self.idle_mark = now - self.idle_mark, now
        used = 0.0
        for w, stats in self.control("stats"):
            if stats is None:
                continue
            pid, total = int(stats["pid"]), float(stats["request_s"])
            used += total - w.mark[1] if pid == w.mark[0] else total  # a restarted worker counts from 0
            w.mark = (pid, total)
        return min(1.0, max(0.0, 1.0 - used / (max(servers, 1) * max(elapsed, 1e-9))))
