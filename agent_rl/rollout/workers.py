"""Rollout workers (`rollout.workers: N`): the episodes of a run played in N processes, each with its own event
loop, environments and sampler, on a Ray cluster. The entry a run calls, importing Ray only when N > 0.

Owns: `rollout_workers` (a run's `rollout.players.Served`: at N = 0 the sampler as it is and the players the caller
plays with here; else `PooledSampler`, the same sampler with N workers behind it: a new policy, a hold, a release
is true on every worker before the call returns, requests in flight are counted on every worker, the servers its
supervisor marks down or back are told to every worker as it happens; and the workers' pool, which plays the
episodes);
`ray_cluster` (the cluster joined or started early, so that one that does not answer is one line before anything
slow starts); `need_ray` (the line when Ray is not installed).
Does not own: a worker's body (`rollout.worker`), the pool, routing and deaths (`rollout.ray_pool`), joining
the cluster (`rollout.ray_connect`).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from agent_rl.core.config import ConfigError, RayConfig
from agent_rl.core.types import Message
from agent_rl.rollout.players import Players, Served
from agent_rl.rollout.remote_gate import WatchedGate
from agent_rl.rollout.sampler import Completion, SamplingParams, ServedSampler, ServerGate
from agent_rl.rollout.worker import Kit, ServedState, WorkerSettings

if TYPE_CHECKING:  # the pool imports Ray: only when workers are asked for
    from agent_rl.rollout.ray_pool import WorkerPool


def need_ray(workers: int) -> None:
    """The one line when `rollout.workers` asks for Ray and it is not installed."""
    if workers and importlib.util.find_spec("ray") is None:
        raise ConfigError("rollout.workers", f"{workers} workers run on Ray, which is not installed: "
                                             f"pip install 'agent-rl[ray]'")


@contextlib.contextmanager
def ray_cluster(settings: RayConfig, workers: int) -> Iterator[None]:
    """Joined (or started) for the `with` block when `workers` > 0, so that a cluster that does not answer is one
    line before anything slow starts; nothing at 0 (`rollout.ray_connect.connected`)."""
    if not workers:
        yield
        return
    need_ray(workers)
    from agent_rl.rollout import ray_connect  # Ray only when workers are asked for

    with ray_connect.connected(settings, workers):
        yield


@contextlib.asynccontextmanager
async def rollout_workers(workers: int, kit: Callable[[], Kit], sampler: ServedSampler, here: Players,
                          settings: WorkerSettings = WorkerSettings()) -> AsyncIterator[Served]:
    """`sampler` itself, and `here` playing the episodes, at `workers` = 0. Else `workers` rollout workers, each
    building `kit()` (a picklable function: it runs in the worker's process), which play the episodes, and a
    sampler that passes every change of the served policy on to each of them before it returns (`PooledSampler`);
    the workers are stopped on exit. A sampler that is not a `ServedSampler` (a scripted one, in tests) works too:
    its `policy_version` is then all it serves."""
    if not workers:
        yield Served(sampler, here)
        return
    need_ray(workers)
    from agent_rl.rollout import ray_connect, ray_pool  # Ray only when workers are asked for

    with ray_connect.connected(settings.ray, workers):
        pool = await ray_pool.WorkerPool.start(workers, kit, settings)
        pool.servers = len(getattr(sampler, "urls", ())) or 1
        pooled = None
        try:
            pooled = PooledSampler(sampler, pool)
            yield Served(pooled, pool)
        finally:
            if pooled is not None:
                pooled.close()
            pool.stop()


class PooledSampler:
    """Rank 0's sampler with rollout workers behind it (`rollout_workers`): a `ServedSampler` whose
    changes reach every worker before they return."""

    def __init__(self, local: ServedSampler, pool: WorkerPool):
        self.local, self.pool = local, pool
        self._unlisten: Callable[[], None] = _nothing
        pool.state = ServedState(0, getattr(local, "model", None), local.policy_version)
        self._watch(getattr(local, "gate", None))

    def close(self) -> None:
        """Stop following the gate (the workers are stopped next; a restart may still end after)."""
        self._unlisten()
        self._unlisten = _nothing

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

    @property
    def gate(self) -> ServerGate | None:
        """Rank 0's gate (`rollout.supervisor`): the weight syncs leave out the servers it says are down."""
        return getattr(self.local, "gate", None)

    @gate.setter
    def gate(self, gate: ServerGate | None) -> None:
        self.local.gate = gate
        self._watch(gate)
        self.pool.tell("adopt", self.pool.state)

    def _watch(self, gate: ServerGate | None) -> None:
        """Route every worker by `gate` (the supervisor `session.supervised_sampling` bound the sampler to): its
        state goes out with the next episodes, and each change to every worker at once (`_gate_changed`). A gate
        without a state to send (a test's stand-in) routes rank 0's own requests only; the workers' go anywhere."""
        self.close()
        self.pool.gate = gate
        watched = gate if isinstance(gate, WatchedGate) else None
        self.pool.state = replace(self.pool.state, seq=self.pool.state.seq + 1,
                                  gate=None if watched is None else watched.state())
        if watched is not None:
            self._unlisten = watched.listen(self._gate_changed)

    def _gate_changed(self) -> None:
        """A server went down or came back (or the run cannot go on), as the supervisor marks it. Every worker is
        told, not waited for (the supervisor calls this in the middle of its own work): a worker that has not yet
        heard still sends to a server gone, and learns it from the answer to its question (`rollout.remote_gate`);
        a server back has been restored before this call, so no worker sends it a request before its weights."""
        gate = cast(WatchedGate, self.pool.gate)
        state = self.pool.state = replace(self.pool.state, seq=self.pool.state.seq + 1, gate=gate.state())
        self.pool.tell("adopt", state)

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
        state = self.pool.state = replace(self.pool.state, seq=self.pool.state.seq + 1, **what)
        self.pool.control("adopt", state)

    # -- sampling here (a burst of model.sync: auto) --------------------------------------------------------------

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
                     messages: Sequence[Message] = ()) -> Completion:
        return await self.local.sample(prompt_ids, params, messages)

    def stats(self) -> dict[int, dict[str, float]]:
        """The figures of each worker that is up (`RolloutWorker.stats`), by its index."""
        return {w.index: s for w, s in self.pool.control("stats") if s is not None}


def _nothing() -> None:
    pass
