"""Rollout workers (`rollout.workers: N`): the episodes of a run played in N processes, each with its own event
loop, environments and sampler, on a Ray cluster. The entry a run calls, importing Ray only when N > 0.

Owns: `rollout_workers` (the sampler a run samples through: unchanged at N = 0, else the same sampler with N
workers behind it, `rollout.ray_pool`), `ray_cluster` (the cluster joined or started early, so that one that
does not answer is one line before anything slow starts), `need_ray` (the line when Ray is not installed).
Does not own: a worker's body (`rollout.worker`), the pool, routing and deaths (`rollout.ray_pool`).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import AsyncIterator, Callable, Iterator

from agent_rl.core.config import ConfigError, RayConfig
from agent_rl.rollout.sampler import ServedSampler
from agent_rl.rollout.worker import Kit, WorkerSettings


def need_ray(workers: int) -> None:
    """The one line when `rollout.workers` asks for Ray and it is not installed."""
    if workers and importlib.util.find_spec("ray") is None:
        raise ConfigError("rollout.workers", f"{workers} workers run on Ray, which is not installed: "
                                             f"pip install 'agent-rl[ray]'")


@contextlib.contextmanager
def ray_cluster(settings: RayConfig, workers: int) -> Iterator[None]:
    """Joined (or started) for the `with` block when `workers` > 0, so that a cluster that does not answer is one
    line before anything slow starts; nothing at 0 (`rollout.ray_pool.connected`)."""
    if not workers:
        yield
        return
    need_ray(workers)
    from agent_rl.rollout import ray_pool  # Ray only when workers are asked for

    with ray_pool.connected(settings, workers):
        yield


@contextlib.asynccontextmanager
async def rollout_workers(workers: int, kit: Callable[[], Kit], sampler: ServedSampler,
                          settings: WorkerSettings = WorkerSettings()) -> AsyncIterator[ServedSampler]:
    """`sampler` itself at `workers` = 0. Else `workers` rollout workers, each building `kit()` (a picklable
    function: it runs in the worker's process), and a sampler that plays episodes on them
    (`rollout.stream.remote_players` finds them) and passes every change of the served policy on to each of
    them before it returns (`rollout.ray_pool.PooledSampler`); the workers are stopped on exit. A sampler that
    is not a `ServedSampler` (a scripted one, in tests) works too: its `policy_version` is then all it serves."""
    if not workers:
        yield sampler
        return
    need_ray(workers)
    from agent_rl.rollout import ray_pool  # Ray only when workers are asked for

    async with ray_pool.pooled(workers, kit, sampler, settings) as pooled:
        yield pooled
