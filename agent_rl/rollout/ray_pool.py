"""Rollout workers on Ray, seen from rank 0: the cluster, the pool of workers, and the sampler a weight sync talks to.

Owns: `connected` (join `ray.address` or RAY_ADDRESS, else start a one-machine cluster sized for the workers:
their CPUs and custom resources; an address that does not answer is one line, before Ray's own minutes of
retries); `WorkerPool` (N `rollout.worker.RolloutWorker` actors with the `ray` section's resources and
restarts; each episode sent to the worker with the fewest in flight among those up; a worker's death makes the
episodes it held infrastructure errors, and its restart is waited for aside); `PooledSampler` (rank 0's sampler
as the stream and every weight sync see it: a new policy, a hold, a release is true on every worker before the
call returns, and requests in flight are counted on every worker); `pooled`, all of it as one async context.
Does not own: a worker's body and what it plays with (`rollout.worker`), an episode (`rollout.runner`), which
episodes play when (`rollout.stream`), pushes (`rollout.weight_sync`).

Routing over the servers. Each worker's sampler sends its requests to the server with the fewest of *its own*
requests outstanding (`VLLMSampler`); no worker sees the others' load. Each worker levels its own share, so a
server's load is the sum of W levelled shares, within about W requests of even: small beside the loads where
balance matters (8,192 episodes on 64 servers is ~128 a server). One global count would cost a round trip to a
shared counter on every request.

A worker's death. Its episodes in flight end as infrastructure errors (`WorkerDied: ...`), which
`rollout.on_error` treats like any other: under `retry` (the default) each is played again from its start with
its own seeds, on a worker that is up, so the step trains what an unfaulted run trains. Ray restarts the worker
(`ray.max_restarts`); it is given episodes again once it answers, and learns the served policy from the first.
Once every worker is dead for good (restarts used up) the run ends with a `WorkerError` line.

Control calls block rank 0's event loop for one round trip to each worker (a push, its hold and release, the
in-flight counts a push reads, the idle share once a step): a push must not end while a worker still sends
requests to the old policy, and the `ServedSampler` protocol the syncs call is synchronous.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

from agent_rl.core.config import ConfigError, RayConfig
from agent_rl.core.types import Message, StopReason, Trajectory
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.rollout.sampler import Completion, SamplingParams, ServedSampler
from agent_rl.rollout.worker import Kit, RolloutWorker, ServedState, WorkerError, WorkerSettings

CONTROL_TIMEOUT_S = 30.0  # a control call to a worker that is up: past it the worker is hung, the run ends


def _first_line(e: BaseException) -> str:
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return lines[0] if lines else type(e).__name__


def _answers(where: str, address: str) -> None:
    """Whether anything listens at the cluster's address, with a 5 s deadline: Ray itself retries for minutes."""
    if address == "auto":
        return  # Ray looks for a cluster on this machine and says at once if there is none
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5.0):
            pass
    except (OSError, ValueError) as e:
        raise ConfigError(where, f"no Ray cluster answers at {address} ({type(e).__name__}: {e}); start its head "
                                 f"(ray start --head) or fix the address") from None


@contextlib.contextmanager
def connected(settings: RayConfig, workers: int) -> Iterator[None]:
    """Ray initialised for the block, then shut down; left as it is when the caller has initialised it already.
    `ray.address` (else RAY_ADDRESS) joins that cluster; without one (or with `local`) a cluster of this machine
    starts with room for the workers: at least their CPUs, and the custom resources they ask for."""
    if ray.is_initialized():
        yield
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a run phones nobody
    where, address = ("ray.address", settings.address) if settings.address else \
        ("RAY_ADDRESS", os.environ.get("RAY_ADDRESS"))
    if address and address != "local":
        _answers(where, address)
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        if address and address != "local":
            ray.init(address=address, logging_level=logging.ERROR)
        else:
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(workers * settings.num_cpus)),
                     resources={k: v * workers for k, v in settings.resources.items()}, include_dashboard=False,
                     object_store_memory=512 * 2**20, logging_level=logging.ERROR)
    except (ConnectionError, RuntimeError, ValueError) as e:
        what = f"could not join the Ray cluster at {address}" if address and address != "local" else \
            "could not start a Ray cluster on this machine"
        raise ConfigError(where, f"{what}: {_first_line(e)}") from None
    finally:  # ray.init makes SIGTERM exit the process at once; the run's own handling stays (`cli`, `preemption`)
        if threading.current_thread() is threading.main_thread() and sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)
    try:
        yield
    finally:
        ray.shutdown()


@dataclass(eq=False)
class _Worker:
    index: int
    handle: Any  # a Ray actor handle of `RolloutWorker`
    pid: int = 0
    episodes: int = 0  # in flight on it
    up: bool = True  # answering; a worker that died is not, until its restart answers
    dead: bool = False  # for good: restarts used up, or it did not come back in time
    mark: tuple[int, float] = (0, 0.0)  # (pid, request-seconds) at the last idle-share reading


def _failed(task: dict[str, Any], error: str, version: int) -> Trajectory:
    env = task["env"] if isinstance(task.get("env"), str) else ""
    return Trajectory(task_id=str(task.get("id", "")), token_ids=(), loss_mask=(), logprobs=(), prompt_len=0,
                      turns=(), messages=(), tool_calls=(), stop_reason=StopReason.ERROR, error=error,
                      policy_version=version, env=env)


class WorkerPool:
    """The rollout workers of one run, and where each episode goes."""

    def __init__(self, workers: list[_Worker], settings: WorkerSettings):
        self.workers, self.settings = workers, settings
        self.some_up = asyncio.Event()
        self.some_up.set()
        self.probes: set[asyncio.Task[None]] = set()
        self.turn = 0  # rotates the ties between equally loaded workers
        self.last_death = ""
        self.idle_mark = time.monotonic()

    @classmethod
    async def start(cls, n: int, kit: Callable[[], Kit], settings: WorkerSettings) -> WorkerPool:
        """`n` workers, each building `kit()`; returns once every one answers (`ray.start_timeout_s`)."""
        r = settings.ray
        actor = ray.remote(RolloutWorker).options(
            num_cpus=r.num_cpus, resources=dict(r.resources), max_restarts=r.max_restarts, max_task_retries=0,
            max_concurrency=settings.max_concurrent + 16)  # the episodes it may get, and room for control calls
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
        return pool

    def stop(self) -> None:
        for task in self.probes:
            task.cancel()
        for w in self.workers:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(w.handle, no_restart=True)

    def deadline_s(self, limits: EpisodeLimits) -> float:
        """A backstop for one episode, far past its own deadlines (each request and environment call has one):
        only a worker that hangs without dying reaches it."""
        return (limits.max_turns + 2) * (4 * self.settings.request_timeout_s + limits.env_timeout_s)

    async def play(self, task: dict[str, Any], index: int, limits: EpisodeLimits, state: ServedState) -> Trajectory:
        """Rollout `index` of `task` on the least busy worker; an infrastructure error if the worker dies."""
        worker = await self._pick()
        worker.episodes += 1
        ref = worker.handle.play.remote(task, index, limits, state)
        try:
            traj: Trajectory = await asyncio.wait_for(ref, self.deadline_s(limits))
            return traj
        except RayActorError as e:
            self._lost(worker, e)
            return _failed(task, f"WorkerDied: rollout worker {worker.index} (pid {worker.pid}) stopped while "
                                 f"playing it: {_cause(e)}", state.version)
        except TimeoutError:
            ray.cancel(ref)
            return _failed(task, f"WorkerTimeout: rollout worker {worker.index} played it for more than "
                                 f"{self.deadline_s(limits):g} s", state.version)
        except asyncio.CancelledError:
            ray.cancel(ref)  # the stream is closing: the worker stops playing it too
            raise
        finally:
            worker.episodes -= 1

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
        low = min(w.episodes for w in up)
        self.turn += 1
        tied = [w for w in up if w.episodes == low]
        return tied[self.turn % len(tied)]

    def _lost(self, worker: _Worker, error: BaseException) -> None:
        """A call to `worker` found it dead: no episode goes to it until its restart answers."""
        self.last_death = f"rollout worker {worker.index} (pid {worker.pid}): {_cause(error)}"
        if worker.up:
            worker.up = False
            task = asyncio.get_running_loop().create_task(self._probe(worker))
            self.probes.add(task)
            task.add_done_callback(self.probes.discard)

    async def _probe(self, worker: _Worker) -> None:
        deadline = time.monotonic() + self.settings.ray.start_timeout_s
        while True:
            try:
                worker.pid, broken = await asyncio.wait_for(worker.handle.ready.remote(), deadline - time.monotonic())
                if broken:  # its restart could not build what it plays with
                    raise WorkerError(broken)
                worker.up = True
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

    def control(self, method: str, *args: Any) -> list[tuple[_Worker, Any]]:
        """`method(*args)` on every worker that is up, waited for (`CONTROL_TIMEOUT_S`): (worker, its answer),
        the answer None for a worker found dead."""
        up = [w for w in self.workers if w.up]
        refs = [getattr(w.handle, method).remote(*args) for w in up]
        out: list[tuple[_Worker, Any]] = []
        for w, ref in zip(up, refs):
            try:
                out.append((w, ray.get(ref, timeout=CONTROL_TIMEOUT_S)))
            except RayActorError as e:  # died: it has nothing in flight, and learns the state from its next episode
                self._lost(w, e)
                out.append((w, None))
            except GetTimeoutError:
                raise WorkerError(f"rollout worker {w.index} (pid {w.pid}) did not answer {method} within "
                                  f"{CONTROL_TIMEOUT_S:g} s") from None
        return out

    def idle_share(self, servers: int) -> float:
        """The servers' idle share since the last call, estimated from the workers' request-seconds: one minus
        the mean requests in flight per server, at least 0. A lower bound of the share `rollout.stream.IdleMeter`
        measures in one process (the same while fewer requests than servers are in flight)."""
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


def _cause(e: BaseException) -> str:
    """A worker's failure in one line: the exception its creation raised, else the first line of Ray's error."""
    text = str(e)
    raised = [x.strip() for x in text.splitlines() if x.strip() and not x.startswith((" ", "\t"))
              and ("Error:" in x or "Exception:" in x) and not x.startswith(("ray.exceptions", "The actor"))]
    return raised[-1] if raised else _first_line(e)


class PooledSampler:
    """Rank 0's sampler with rollout workers behind it (`rollout.workers.rollout_workers`): a `ServedSampler` whose
    changes reach every worker before they return, and the `rollout.stream.Players` the stream plays through."""

    def __init__(self, local: ServedSampler, pool: WorkerPool):
        self.local, self.pool = local, pool
        self.state = ServedState(0, getattr(local, "model", None), local.policy_version)

    # -- the served policy, as every weight sync sees it ------------------------------------------------------

    @property
    def model(self) -> str:
        return self.local.model

    @model.setter
    def model(self, name: str) -> None:
        self.set_policy(name, self.policy_version)

    @property
    def policy_version(self) -> int:
        return self.local.policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:  # a scripted sampler's push (tests): the version alone
        self.local.policy_version = version
        self._change(version=version)

    @property
    def urls(self) -> list[str]:
        return list(getattr(self.local, "urls", []))

    def set_policy(self, model: str, version: int) -> None:
        self.local.set_policy(model, version)
        self._change(model=model, version=version)

    def hold(self) -> None:
        self.local.hold()
        self._change(held=True)

    def release(self) -> None:
        self.local.release()
        self._change(held=False)

    def in_flight(self, url: str | None = None, model: str | None = None) -> int:
        here = getattr(self.local, "in_flight", None)
        there = sum(n or 0 for _, n in self.pool.control("in_flight", url, model))
        return (0 if here is None else int(here(url, model))) + there

    def _change(self, **what: Any) -> None:
        self.state = replace(self.state, seq=self.state.seq + 1, **what)
        self.pool.control("adopt", self.state)

    # -- sampling here (a burst of model.sync: auto), and episodes on the workers ------------------------------

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
                     messages: Sequence[Message] = ()) -> Completion:
        return await self.local.sample(prompt_ids, params, messages)

    async def play(self, task: dict[str, Any], index: int, limits: EpisodeLimits) -> Trajectory:
        return await self.pool.play(task, index, limits, self.state)

    def idle_share(self) -> float:
        return self.pool.idle_share(len(self.urls) or 1)

    def stats(self) -> dict[int, dict[str, float]]:
        """The figures of each worker that is up (`RolloutWorker.stats`), by its index."""
        return {w.index: s for w, s in self.pool.control("stats") if s is not None}


@contextlib.asynccontextmanager
async def pooled(workers: int, kit: Callable[[], Kit], sampler: ServedSampler,
                 settings: WorkerSettings) -> AsyncIterator[PooledSampler]:
    """`workers` rollout workers on the cluster (`connected`), and `sampler` with them behind it; stopped on exit."""
    with connected(settings.ray, workers):
        pool = await WorkerPool.start(workers, kit, settings)
        try:
            yield PooledSampler(sampler, pool)
        finally:
            pool.stop()
