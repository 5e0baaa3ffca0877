"""The rollout stream: groups played all the time, each step's batch handed over as soon as the staleness
bound allows.

Owns: `TaskStream` (the run's tasks in a fixed order, and a position); `RolloutStream`: the slots that
`rollout.admission` opens as weight pushes come in, each given the next task and played as G episodes on
`rollout.max_concurrent` workers; a group's reward scored when the group ends; refills (a group without
signal, under dynamic sampling, or lost whole to infrastructure errors, gives its slot to the next task,
up to `algorithm.max_resample_batches` times); `batch(step)` (waits for what `Admission.choose` needs),
`pushed(version)`; where episodes play (here, or on rollout workers: `Players`, `remote_players`); the episode
failure policy (`on_error`: a failed episode played again with its own seeds
in a fresh environment, or its group kept out of the update) and the failures' counts by type (`error/<type>`);
an episode whose server died under it (the sampler's `ServerLost`, marked `Trajectory.server_lost`, here or on
a rollout worker) replayed the same way whatever `on_error` says, free of its retries and of the failure counts
(`fault/replayed_episodes`);
what a checkpoint keeps (`state`), and the stream's figures (time waited, the servers'
idle share, episodes in flight).
Does not own: one episode (`rollout.runner`), the staleness rule (`rollout.admission`), whether a group has
signal (the caller's predicate, `learn.advantages.has_signal`), the training loop (`trainer`).

Waves. The groups started together form a wave labelled (target step, round): the B slots of a target open
together as round 0; once every group of wave (t, r) has ended, those to refill take the next tasks, in
slot order, as wave (t, r + 1). The label seeds the wave's requests, `step_seed(run seed, t, r)`, then
`request_seed` per task, rollout and turn: at k = 0 the synchronous loop's step and round, at k = 1 the
old one-step overlap's. A batch lists its groups in task order, as the synchronous loop did.

Resume. A checkpoint holds the task position and, for each slot not yet trained, its group's round and
task position (`state`). A resumed stream plays those groups again from their start, same tasks and
seeds: no task is skipped and none is trained twice.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from agent_rl.core.env import Env
from agent_rl.core.renderers.base import Renderer
from agent_rl.core.types import Message, Trajectory, TrajectoryGroup
from agent_rl.rollout.admission import Admission
from agent_rl.rollout.quiet_gc import ROLLOUT_GC
from agent_rl.rollout.runner import EpisodeLimits, play_task, score_group, step_seed
from agent_rl.rollout.sampler import Completion, Sampler, SamplingParams


@dataclass
class TaskStream:
    """Tasks in a fixed shuffled order; `position` is the next one to hand out. A mixture of environments
    is one list too (`core.mixture`, slot order), so its position is one number as well."""

    tasks: list[dict[str, Any]]
    position: int = 0

    def take(self, n: int) -> list[dict[str, Any]]:
        out = [self.at(self.position + i) for i in range(n)]
        self.position += n
        return out

    def at(self, position: int) -> dict[str, Any]:
        return self.tasks[position % len(self.tasks)]

    def positions(self, position: int) -> dict[str, float]:
        """`data_position`, and in a mixture how many tasks each environment has given before it."""
        tags: list[str | None] = [t["env"] if isinstance(t.get("env"), str) else None for t in self.tasks]
        taken = Counter(tags[i % len(tags)] for i in range(position)) if tags else Counter()
        return {"data_position": float(position),
                **{f"data_position/{e}": float(taken[e]) for e in sorted({e for e in tags if e is not None})}}


def legacy_state(saved: Any, step: int, batch: int) -> dict[str, Any]:
    """A checkpoint's stream `state`; one written before the stream kept only the task position (an int):
    then `step` x `batch` slots had been trained and none was open."""
    if isinstance(saved, dict):
        return saved
    return {"position": int(saved), "opened": step * batch, "open": [], "groups": []}


def error_type(error: str | None) -> str:
    """The type an episode's error is counted under (`error/<type>`): the exception's name in the runner's text,
    `ValueError: bad`, `environment could not start: ValueError: bad`; `group_reward` for a group reward's."""
    text = (error or "").removeprefix("environment could not start: ")
    if text.startswith("group reward failed"):
        return "group_reward"
    name = text.split(":", 1)[0].strip()
    return name if name.isidentifier() else "other"


def _now() -> float:
    """The event loop's clock: a simulated one (bench/async_sim.py) makes every figure here simulated too."""
    return asyncio.get_running_loop().time()


@runtime_checkable
class Players(Protocol):
    """Episodes played elsewhere: on rollout workers (`rollout.workers`), each with its own environments and
    sampler; the servers' idle share as they measure it."""

    async def play(self, task: dict[str, Any], index: int, limits: EpisodeLimits) -> Trajectory: ...

    def idle_share(self) -> float: ...


def remote_players(sampler: Sampler) -> Players | None:
    """The sampler's workers, when its episodes play on them (`rollout.workers`); None: in this process."""
    return sampler if isinstance(sampler, Players) else None


@dataclass(frozen=True)
class Episodes:
    """How the stream plays a group: what `rollout.runner.rollout_groups` takes, as one value."""

    make_env: Callable[[dict[str, Any]], Env]
    sampler: Sampler
    renderer: Renderer
    limits: EpisodeLimits
    group_size: int
    group_reward: Callable[..., Any] | None = None
    on_error: str = "keep"  # an episode that failed: "retry" (then drop its group), "drop_group" or "keep"
    max_retries: int = 0  # replays of a failed episode under "retry"
    players: Players | None = None  # where the episodes play (`rollout.workers`); None: here, through `sampler`


class IdleMeter:
    """A sampler that counts its requests in flight: with N servers and least-outstanding routing
    (`VLLMSampler`), N - m of them are idle while m < N requests run. Integrates that over time."""

    def __init__(self, inner: Sampler, servers: int):
        self.inner, self.servers = inner, max(1, servers)
        self.running, self.idle_s, self.since = 0, 0.0, _now()
        self._mark = (self.since, 0.0)

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:  # the Sampler protocol's field: the inner sampler's
        self.inner.policy_version = version

    def _tick(self, change: int) -> None:
        now = _now()
        self.idle_s += (now - self.since) * max(0, self.servers - self.running) / self.servers
        self.since, self.running = now, self.running + change

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
                     messages: Sequence[Message] = ()) -> Completion:
        self._tick(+1)
        try:
            return await self.inner.sample(prompt_ids, params, messages)
        finally:
            self._tick(-1)

    def idle_share(self) -> float:
        """The servers' idle share since the last call."""
        self._tick(0)
        t0, idle0 = self._mark
        self._mark = (self.since, self.idle_s)
        return (self.idle_s - idle0) / max(self.since - t0, 1e-9)


@dataclass(eq=False)
class _Group:
    slot: int
    label: tuple[int, int]  # (target step, round)
    position: int  # of its task in the TaskStream
    task: dict[str, Any]
    trajs: list[Trajectory | None]
    refill: bool | None = None  # None while playing or scoring
    dropped: bool = False  # an episode failed (after its retries) and `on_error` drops the group from the update
    retries: Counter[int] = field(default_factory=Counter)  # episode index -> replays so far
    ended: TrajectoryGroup | None = None
    wave: list[_Group] = field(default_factory=list)  # the groups started with it: its refill waits for them


@dataclass
class _Counts:
    busy: int = 0  # episodes queued or running, and groups being scored
    running: int = 0  # episodes being played
    gc: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)


class RolloutStream:
    """Group slots played continuously; `batch(step)` hands a step its groups (module doc).

        async with RolloutStream(tasks, episodes, admission, run_seed=0, max_concurrent=64) as stream:
            stream.start(version)          # the slots the starting version opens (or a checkpoint's)
            groups, metrics = await stream.batch(step)
            ... train, push ...
            stream.pushed(step + 1)
    """

    def __init__(self, tasks: TaskStream, episodes: Episodes, admission: Admission, *, run_seed: int,
                 max_concurrent: int, max_rounds: int = 0, signal: Callable[[TrajectoryGroup], bool] | None = None,
                 servers: int = 1):
        self.tasks, self.episodes, self.admission = tasks, episodes, admission
        self.run_seed, self.max_rounds, self.signal = run_seed, max_rounds, signal
        self.meter = IdleMeter(episodes.sampler, servers)
        self.groups: dict[int, _Group] = {}  # open slot -> its current group
        self.queue: asyncio.Queue[tuple[_Group, int]] = asyncio.Queue()
        self.workers = max(1, max_concurrent)
        self.tasks_running: set[asyncio.Task[None]] = set()
        self.changed = asyncio.Event()
        self.counts = _Counts()
        self.failure: BaseException | None = None
        self.errors: Counter[str] = Counter()  # failed episodes by `error/<type>`, retries, since the last batch

    async def __aenter__(self) -> RolloutStream:
        for _ in range(self.workers):
            self._spawn(self._worker())
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self.tasks_running:
            task.cancel()
        await asyncio.gather(*self.tasks_running, return_exceptions=True)
        self.counts.gc.close()

    @property
    def in_flight(self) -> int:
        """Episodes being played now."""
        return self.counts.running

    def start(self, version: int, saved: dict[str, Any] | None = None) -> None:
        """Play the groups a checkpoint's `state` left open (none on a fresh run), then open what `version` allows."""
        if saved is not None:
            self.tasks.position = int(saved["position"])
            waves: dict[tuple[int, int], list[_Group]] = defaultdict(list)
            for slot, round_, position in saved["groups"]:
                label = (self.admission.target(slot), round_)
                waves[label].append(self._group(slot, label, position))
            for wave in waves.values():
                self._play(wave)
        self.pushed(version)

    def pushed(self, version: int) -> None:
        """The servers sample with `version` now: open the slots it allows, each target's as one wave."""
        waves: dict[int, list[_Group]] = defaultdict(list)
        for slot in self.admission.open_up_to(version):
            target = self.admission.target(slot)
            waves[target].append(self._group(slot, (target, 0), self.tasks.position))
            self.tasks.position += 1
        for wave in waves.values():
            self._play(wave)

    async def batch(self, step: int) -> tuple[list[TrajectoryGroup], dict[str, float]]:
        """Step `step`'s groups, in task order, once `Admission.choose` allows; and the stream's figures."""
        t0 = _now()
        while True:
            if self.failure is not None:
                raise self.failure
            kept = [g.slot for g in self.groups.values() if g.refill is False]
            chosen = self.admission.choose(step, kept)
            if chosen is not None:
                break
            if self.counts.busy == 0:  # nothing will ever change: a bug, not a wait
                raise RuntimeError(f"rollout stream stalled at step {step}: slots {sorted(self.groups)} open, "
                                   f"none playing (was `pushed` called after each push?)")
            self.changed.clear()
            await self.changed.wait()
        self.admission.take(chosen)
        mine = sorted((self.groups.pop(n) for n in chosen), key=lambda g: g.position)
        metrics = {"time/wait_s": _now() - t0, "resample_batches": float(max((g.label[1] for g in mine), default=0)),
                   "server_idle_share": self._idle_share(), "stream/buffered": float(len(kept) - len(mine)),
                   "stream/open_slots": float(len(self.groups)), "error/retried": 0.0, "fault/replayed_episodes": 0.0,
                   "error/dropped_groups": float(sum(g.dropped for g in mine)),
                   **{k: float(v) for k, v in sorted(self.errors.items())}}
        self.errors.clear()
        return [g.ended for g in mine if g.ended is not None and not g.dropped], metrics

    def _idle_share(self) -> float:
        players = self.episodes.players
        return self.meter.idle_share() if players is None else players.idle_share()

    def data_position(self) -> int:
        """Every task before this position has been trained or tried: where the synchronous loop would resume."""
        return min((g.position for g in self.groups.values()), default=self.tasks.position)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (JSON): the task position, the slots, each open slot's group (round, task)."""
        groups = sorted(self.groups.values(), key=lambda g: g.slot)
        return {"position": self.tasks.position, **self.admission.to_json(),
                "groups": [[g.slot, g.label[1], g.position] for g in groups]}

    # -- playing -------------------------------------------------------------------------------------------

    def _group(self, slot: int, label: tuple[int, int], position: int) -> _Group:
        group = _Group(slot, label, position, self.tasks.at(position), [None] * self.episodes.group_size)
        self.groups[slot] = group
        return group

    def _play(self, wave: list[_Group]) -> None:
        for group in wave:
            group.wave = wave
            for index in range(self.episodes.group_size):
                self._busy(+1)
                self.queue.put_nowait((group, index))

    def _busy(self, change: int) -> None:
        """Count work in progress; the garbage collector is quiet while there is any (`rollout.quiet_gc`)."""
        if self.counts.busy == 0 and change > 0:
            self.counts.gc.enter_context(ROLLOUT_GC.quiet())
        self.counts.busy += change
        if self.counts.busy == 0:
            self.counts.gc.close()
            self.changed.set()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks_running.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks_running.discard(task)
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self.failure = task.exception()  # a bug: `batch` raises it
            self.changed.set()

    async def _worker(self) -> None:
        ep = self.episodes
        while True:
            me = asyncio.current_task()
            if me is not None and me.cancelling():  # a cancel an episode swallowed (3.11's wait_for can): obey it
                raise asyncio.CancelledError
            group, index = await self.queue.get()
            limits = replace(ep.limits, seed=step_seed(self.run_seed, *group.label))
            self.counts.running += 1
            try:
                if ep.players is not None:  # on a worker: the same episode, its trajectory sent back
                    traj = await ep.players.play(group.task, index, limits)
                else:
                    traj = await play_task(group.task, index, ep.make_env, self.meter, ep.renderer, limits)
            finally:
                self.counts.running -= 1
            ROLLOUT_GC.collect_if_piling_up()
            if traj.infra_error and self._retry(group, index, traj):
                continue  # played again from the start, same seeds, a fresh environment; still counted busy
            group.trajs[index] = traj
            if all(t is not None for t in group.trajs):
                self._spawn(self._end(group))  # scored beside the episodes still running
            else:
                self._busy(-1)

    def _retry(self, group: _Group, index: int, traj: Trajectory) -> bool:
        """Count a failed episode by its error's type; queue it again if `on_error: retry` has retries left. An
        episode whose server died under it (`Trajectory.server_lost`, here or on a rollout worker) is queued again
        in any case: not its failure (the supervisor restarts the server, or the run stops: `rollout.supervisor`),
        so neither counted as one nor charged a retry."""
        if traj.server_lost:
            self.errors["fault/replayed_episodes"] += 1
            self.queue.put_nowait((group, index))
            return True
        self.errors[f"error/{error_type(traj.error)}"] += 1
        if self.episodes.on_error != "retry" or group.retries[index] >= self.episodes.max_retries:
            return False
        group.retries[index] += 1
        self.errors["error/retried"] += 1
        self.queue.put_nowait((group, index))
        return True

    async def _end(self, group: _Group) -> None:
        """A group's episodes have all ended: its group reward, whether it keeps its slot, its wave's refills."""
        ended = [t for t in group.trajs if t is not None]
        if self.episodes.group_reward is not None:
            failed = sum(t.infra_error for t in ended)
            ended = await score_group(self.episodes.group_reward, group.task, ended, self.episodes.limits.env_timeout_s)
            self.errors["error/group_reward"] += sum(t.infra_error for t in ended) - failed
        group.ended = TrajectoryGroup(str(group.task.get("id", "")), tuple(ended))
        # on_error keep: the episodes that did not fail train (a group lost whole refills); else the group is out
        group.dropped = self.episodes.on_error != "keep" and any(t.infra_error for t in ended)
        group.refill = group.label[1] < self.max_rounds and (
            group.dropped or all(t.infra_error for t in ended)
            or (self.signal is not None and not self.signal(group.ended)))
        wave = group.wave
        if all(g.refill is not None for g in wave):
            target, round_ = group.label
            refills = [self._group(g.slot, (target, round_ + 1), self.tasks.position + i)
                       for i, g in enumerate(sorted((g for g in wave if g.refill), key=lambda g: g.slot))]
            self.tasks.position += len(refills)
            self._play(refills)
        self._busy(-1)
        self.changed.set()
