"""Where episodes play: in this process, or on rollout workers; and the one meter of a sampler's requests.

Owns: `Players` (what plays an episode of a task and measures the servers' idle share: `LocalPlayers` here, a
`rollout.ray_pool.WorkerPool` on Ray workers), `LocalPlayers` (`rollout.runner.play_task` with the session's
environments, renderer and sampler), `RequestMeter` (a sampler that counts its turns and integrates its requests in
flight over time: request-seconds, and the servers' idle seconds with least-outstanding routing), and `Served` (what
a session's serving gives a command: the sampler every weight sync pushes to, and where the episodes play).
Does not own: one episode (`rollout.runner`), when episodes play and how groups end (`rollout.engine`), the workers
themselves (`rollout.workers`, `rollout.ray_pool`), which of the two a run uses (the session builds it once:
`session.sampling`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agent_rl.core.env import Env
from agent_rl.core.renderers.base import Renderer
from agent_rl.core.types import Branch, Message, Trajectory
from agent_rl.rollout.runner import EpisodeLimits, play_task
from agent_rl.rollout.sampler import Completion, Sampler, SamplingParams, ServedSampler


class Players(Protocol):
    """Plays rollout `index` of `task` under `limits` (its seeds included), a branch of another of its group's
    episodes when `branch` says so (`rollout.branching`), and returns its trajectory, never raising for an episode's
    own failures; and says how idle the servers were since it was last asked."""

    async def play(self, task: dict[str, Any], index: int, limits: EpisodeLimits,
                   branch: Branch | None = None) -> Trajectory: ...

    def idle_share(self) -> float: ...


def loop_time() -> float:
    """The event loop's clock: a simulated one (bench/async_sim.py) makes every figure measured with it simulated."""
    return asyncio.get_running_loop().time()


class RequestMeter:
    """A sampler that counts its turns and its requests in flight. With N servers and least-outstanding routing
    (`VLLMSampler`), N - m of them are idle while m < N requests run: `idle_share` integrates that over time;
    `request_s` integrates the requests in flight (what a rollout worker reports, `rollout.ray_pool`)."""

    def __init__(self, inner: Sampler, servers: int = 1, clock: Callable[[], float] = loop_time):
        self.inner, self.servers, self.clock = inner, max(1, servers), clock
        self.turns, self.running, self.request_s, self.idle_s = 0, 0, 0.0, 0.0
        self.since = clock()
        self._mark = (self.since, 0.0)

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:  # the Sampler protocol's field: the inner sampler's
        self.inner.policy_version = version

    def tick(self, change: int = 0) -> None:
        now = self.clock()
        self.request_s += (now - self.since) * self.running
        self.idle_s += (now - self.since) * max(0, self.servers - self.running) / self.servers
        self.since, self.running = now, self.running + change

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
                     messages: Sequence[Message] = ()) -> Completion:
        self.tick(+1)
        try:
            return await self.inner.sample(prompt_ids, params, messages)
        finally:
            self.tick(-1)
            self.turns += 1

    def idle_share(self) -> float:
        """The servers' idle share since the last call."""
        self.tick()
        t0, idle0 = self._mark
        self._mark = (self.since, self.idle_s)
        return (self.idle_s - idle0) / max(self.since - t0, 1e-9)


class LocalPlayers:
    """Episodes played in this process, each in an environment of its own, through a `RequestMeter` over
    `sampler`."""

    def __init__(self, make_env: Callable[[dict[str, Any]], Env], sampler: Sampler, renderer: Renderer,
                 servers: int = 1):
        self.make_env, self.renderer = make_env, renderer
        self.meter = RequestMeter(sampler, servers)

    async def play(self, task: dict[str, Any], index: int, limits: EpisodeLimits,
                   branch: Branch | None = None) -> Trajectory:
        return await play_task(task, index, self.make_env, self.meter, self.renderer, limits, branch)

    def idle_share(self) -> float:
        return self.meter.idle_share()


@dataclass(frozen=True)
class Served:
    """A session's serving, as a command uses it: the sampler the weight syncs push to (with rollout workers, one
    that tells each of them), and where the episodes play."""

    sampler: ServedSampler
    players: Players
