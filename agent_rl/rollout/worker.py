"""One rollout worker (`rollout.workers`): the body of the process that plays a run's episodes on Ray, and what
it plays with.

Owns: `Kit` (what a worker plays with: environments, renderer, sampler, built in the worker's own process by a
function the caller names, so nothing unpicklable travels), `ServedState` (the served policy, whether a push
holds the sampler, and which servers are up, numbered: what every worker's sampler must agree with),
`RolloutWorker` (plays an episode with `rollout.runner.play_task` and sends its trajectory back, follows the newest
`ServedState` it has seen, its sampler routed by a `rollout.remote_gate.MirrorGate` whose questions go back with
the trajectories, counts its requests, turns and CPU), `WorkerSettings`, `WorkerError`. Imports no Ray: Ray runs
the class.
Does not own: starting workers, routing, deaths (`rollout.ray_pool`), the entry a run calls (`rollout.workers`),
an episode (`rollout.runner`), what a kit holds for a run (the caller's kit function, `session.worker_kit`).

Why a worker follows a numbered state rather than obeying each call in turn: Ray runs the calls of an
asynchronous actor out of order, so a `play` sent before a push may start after it. Every call carries the
state rank 0 had when it sent it, and a worker takes a state only if it is newer than the one it has: a
worker that Ray restarted learns the current policy from the first episode it is given.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from agent_rl.core.config import RayConfig
from agent_rl.core.env import Env
from agent_rl.core.renderers.base import Renderer
from agent_rl.core.types import Branch, Trajectory
from agent_rl.rollout.players import RequestMeter
from agent_rl.rollout.quiet_gc import ROLLOUT_GC
from agent_rl.rollout.remote_gate import GateState, MirrorGate
from agent_rl.rollout.runner import EpisodeLimits, play_task
from agent_rl.rollout.sampler import Sampler, ServedSampler

# an episode rank 0 gives a worker: (its id, the task, the rollout index, the limits, the branch it plays or None)
Submitted = tuple[int, dict[str, Any], int, EpisodeLimits, Branch | None]


class WorkerError(Exception):
    """The rollout workers cannot go on (none started in time, every one died for good, one stopped answering);
    the message is one line."""


@dataclass(frozen=True)
class Kit:
    """What a worker plays with, built in its own process."""

    make_env: Callable[[dict[str, Any]], Env]
    renderer: Renderer
    sampler: Sampler  # a `ServedSampler` (vLLM) follows pushes; any other sampler only its `policy_version`


@dataclass(frozen=True)
class ServedState:
    """What rank 0's sampler serves: the policy (`model`, None for a sampler without one) and its version,
    whether a push holds new requests back (`ServedSampler.hold`), and which servers are up (`gate`: its
    supervisor's state; None: no supervisor, every server takes requests). `seq` grows with every change."""

    seq: int = 0
    model: str | None = None
    version: int = 0
    held: bool = False
    gate: GateState | None = None


class RolloutWorker:
    """One rollout worker: Ray runs it as an asynchronous actor (`rollout.ray_pool`); every method is a
    coroutine on the worker's one event loop, episodes and control calls alike."""

    def __init__(self, kit: Callable[[], Kit], index: int):
        self.index, self.broken = index, ""
        self.state = ServedState(seq=-1)
        self.episodes = 0  # ended
        self.playing: dict[int, asyncio.Task[None]] = {}  # episode id (rank 0's) -> its task
        self.finished: list[tuple[int, Trajectory]] = []  # not yet collected by `results`
        self.news = asyncio.Event()  # something finished, or the gate has a question for rank 0
        self.gate = MirrorGate(self.news.set)  # the sampler's, while rank 0 has a supervisor (`_adopt`)
        self.last_results = 0.0
        self.gc, self.quiet = contextlib.ExitStack(), False
        try:
            self.kit = kit()
        except Exception as e:  # said by `ready`: Ray would restart a constructor that raises, again and again
            self.broken = f"{type(e).__name__}: {e}"
            return
        self.meter = RequestMeter(self.kit.sampler, clock=time.monotonic)

    async def ready(self) -> tuple[int, str]:
        """The worker's process id once it is up, and why it cannot play ("" if it can)."""
        return os.getpid(), self.broken

    async def submit(self, episodes: list[Submitted], state: ServedState) -> int:
        """Start playing each (id, task, rollout index, limits: seeds included) as `rollout.runner.play_task`
        plays it; returns at once, with the process id (rank 0 tells a restarted worker by it)."""
        self._adopt(state)
        for eid, task, index, limits, branch in episodes:
            self.playing[eid] = asyncio.ensure_future(self._play(eid, task, index, limits, branch))
        return os.getpid()

    async def results(self, wait_s: float, gap_s: float = 0.005
                      ) -> tuple[int, list[tuple[int, Trajectory]], list[str]]:
        """(process id, the episodes that ended since the last call by id, the servers whose calls failed at the
        connection: rank 0 answers whether each is down, `answer`), once there is one, or after `wait_s`; at most
        one reply every `gap_s`, so that each carries several episodes when many end (Ray's own cost is per call)."""
        if not self.finished and not self.gate.asking:
            self.news.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.news.wait(), wait_s)
        await asyncio.sleep(max(0.0, self.last_results + gap_s - time.monotonic()))
        self.last_results = time.monotonic()
        out, self.finished = self.finished, []
        return os.getpid(), out, self.gate.questions()

    async def answer(self, url: str, down: bool, state: ServedState) -> None:
        """Rank 0's answer to a question of the gate (`results`): whether the server `url` is down, with its state
        then (which says so when it is)."""
        self._adopt(state)
        self.gate.answer(url, down)

    async def cancel(self, eids: list[int]) -> None:
        """Stop playing these episodes (rank 0 no longer waits for them)."""
        for eid in eids:
            task = self.playing.pop(eid, None)
            if task is not None:
                task.cancel()

    async def _play(self, eid: int, task: dict[str, Any], index: int, limits: EpisodeLimits,
                    branch: Branch | None) -> None:
        if not self.quiet:  # the process's garbage collection while episodes run (`rollout.quiet_gc`)
            self.gc.enter_context(ROLLOUT_GC.quiet())
            self.quiet = True
        try:
            traj = await play_task(task, index, self.kit.make_env, self.meter, self.kit.renderer, limits, branch)
        finally:
            self.playing.pop(eid, None)
            if not self.playing and self.quiet:
                self.gc.close()
                self.quiet = False
            ROLLOUT_GC.collect_if_piling_up()
        self.episodes += 1
        self.finished.append((eid, traj))
        self.news.set()

    async def adopt(self, state: ServedState) -> None:
        self._adopt(state)

    async def in_flight(self, url: str | None = None, model: str | None = None) -> int:
        """The requests its sampler has sent and not had answered (to `url`, for `model`)."""
        count = getattr(self.kit.sampler, "in_flight", None)
        return 0 if count is None else int(count(url, model))

    async def stats(self) -> dict[str, float]:
        """Its process id, episodes ended and playing, turns sampled, request-seconds and CPU seconds so far."""
        self.meter.tick()
        return {"pid": float(os.getpid()), "episodes": float(self.episodes), "playing": float(len(self.playing)),
                "turns": float(self.meter.turns), "request_s": self.meter.request_s, "cpu_s": time.process_time()}

    def _adopt(self, state: ServedState) -> None:
        """Take `state` if it is newer than the worker's (module doc: calls may run out of order)."""
        if state.seq <= self.state.seq:
            return
        self.state, sampler = state, self.kit.sampler
        if state.gate is not None:
            self.gate.adopt(state.gate)
        if hasattr(sampler, "gate"):  # a `VLLMSampler`: it routes by rank 0's supervisor, if there is one
            cast(ServedSampler, sampler).gate = None if state.gate is None else self.gate
        if not hasattr(sampler, "set_policy") or state.model is None:  # a scripted sampler: only the version it tags
            sampler.policy_version = state.version
            return
        served = cast(ServedSampler, sampler)
        served.set_policy(state.model, state.version)
        if state.held:
            served.hold()
        else:
            served.release()


@dataclass(frozen=True)
class WorkerSettings:
    """How `rollout_workers` starts its workers: the `ray` section, and the sampler's request deadline."""

    ray: RayConfig = field(default_factory=RayConfig)
    request_timeout_s: float = 300.0  # the sampler's: an episode's backstop deadline is a multiple of it
