"""The rollout engine: every group of G episodes in the project is played here, training's and everyone else's.

Owns: `Episodes` (how a group is played: where, under which limits, how many, its group reward, what a failed
episode does, the truncation rule of its returns), `Engine` (G episodes a group on `max_concurrent` workers that
take the episodes in order; a failed episode played again from its start under `on_error: retry`, an episode whose
server died under it replayed whatever `on_error` says; once a group's last episode ends, its group reward, each
episode's return (`core.returns`), then the caller's `on_end`), `Failures` (what failed since the caller last
asked, by type: the counts a run's stopping decides from, `stopping.mended`), and `play_groups`, the engine on a
fixed list of tasks (evaluation, demonstrations, the audit, `agent-rl rollout`, the benches; `rollout_groups`: the
same in one call for a script of your own, played in this process).
Does not own: one episode (`rollout.runner`), where it plays (`rollout.players`), which tasks are played when and
which groups a training step takes (`rollout.stream`), the return's arithmetic (`core.returns`).

Only the episodes in play exist as coroutines: 100k queued episodes cost 100k queue slots, not 100k suspended
tasks for every garbage collection to walk through; and the collector is quiet while any work is in progress
(`rollout.quiet_gc`).

Failures are data: a failed episode is a trajectory with `StopReason.ERROR`, its error and its `error_type`. Under
`on_error: retry` it is played again with the same seeds in a fresh environment, up to `max_retries` times; under
`drop_group` (or `retry` once retries run out) its group is marked dropped; under `keep` the group keeps its other
episodes. An episode whose own request met its server's death (`Trajectory.server_lost`) is played again in any
case, neither counted as a failure nor charged a retry (the supervisor restarts the server, or the run stops:
`rollout.supervisor`). A group reward that fails makes its group's episodes failures of type `group_reward`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent_rl.core.env import Env
from agent_rl.core.renderers.base import Renderer
from agent_rl.core.returns import scored
from agent_rl.core.types import Branch, Trajectory, TrajectoryGroup
from agent_rl.rollout.branching import BranchRule, branches
from agent_rl.rollout.players import LocalPlayers, Players
from agent_rl.rollout.quiet_gc import ROLLOUT_GC
from agent_rl.rollout.runner import EpisodeLimits, score_group
from agent_rl.rollout.sampler import Sampler


@dataclass(frozen=True)
class Episodes:
    """How the engine plays a group."""

    players: Players  # where the episodes play (`rollout.players`)
    limits: EpisodeLimits  # each group's own seed may replace `limits.seed` (`Engine.play`)
    group_size: int
    group_reward: Callable[..., Any] | None = None  # `core.registry.EnvSpec.group_reward`
    on_error: str = "keep"  # an episode that failed: "retry" (then drop its group), "drop_group" or "keep"
    max_retries: int = 0  # replays of a failed episode under "retry"
    truncated_reward: float | None = None  # the return's truncation rule (`core.returns`)
    branching: BranchRule | None = None  # branches at the tool decision (`rollout.branching`); None: none


@dataclass
class Failures:
    """What went wrong in the episodes played since the engine was last asked (`Engine.failures`)."""

    by_type: Counter[str] = field(default_factory=Counter)  # each failed try of an episode, by `error_type`
    retried: int = 0  # failed episodes queued again (`on_error: retry`)
    replayed: int = 0  # episodes played again after their server died: not failures

    @property
    def failed(self) -> int:
        return sum(self.by_type.values())

    @property
    def all_retried(self) -> bool:
        """Every failure was followed by a retry: if the retries then succeeded, nothing failed in the end."""
        return self.failed == self.retried

    def metrics(self) -> dict[str, float]:
        return {"error/retried": float(self.retried), "fault/replayed_episodes": float(self.replayed),
                **{f"error/{kind}": float(n) for kind, n in sorted(self.by_type.items())}}


@dataclass(eq=False)
class Group:
    """One group in play: `group_size` episodes of `task` under `limits`."""

    task: dict[str, Any]
    limits: EpisodeLimits
    trajs: list[Trajectory | None]
    on_end: Callable[[Group], None]
    retries: Counter[int] = field(default_factory=Counter)  # episode index -> replays so far
    branches: dict[int, Branch] = field(default_factory=dict)  # episode index (G and on) -> the branch it plays
    branched: bool = False  # its episodes' branches were decided (`Episodes.branching`)
    ended: TrajectoryGroup | None = None  # once its last episode has ended and it is scored
    dropped: bool = False  # an episode failed (after its retries) and `on_error` keeps the group out


class Engine:
    """Plays the groups given to it (`play`) on `max_concurrent` workers, as the module doc says.

        async with Engine(episodes, max_concurrent=64) as engine:
            group = engine.play(task, limits, on_end)
            await engine.idle()
    """

    def __init__(self, episodes: Episodes, max_concurrent: int):
        self.episodes = episodes
        self.queue: asyncio.Queue[tuple[Group, int]] = asyncio.Queue()
        self.workers = max(1, max_concurrent)
        self.running_tasks: set[asyncio.Task[None]] = set()
        self.changed = asyncio.Event()  # set whenever a group ends, and when the engine runs out of work
        self.busy = 0  # episodes queued or running, and groups being scored
        self.running = 0  # episodes being played
        self.failure: BaseException | None = None  # a bug in the engine or a callback: every waiter raises it
        self._failures = Failures()
        self._gc = contextlib.ExitStack()

    async def __aenter__(self) -> Engine:
        for _ in range(self.workers):
            self._spawn(self._worker())
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self.running_tasks:
            task.cancel()
        await asyncio.gather(*self.running_tasks, return_exceptions=True)
        self._gc.close()

    def play(self, task: dict[str, Any], limits: EpisodeLimits, on_end: Callable[[Group], None]) -> Group:
        """Queue `group_size` episodes of `task`; `on_end(group)` once they have all ended and the group is scored."""
        group = Group(task, limits, [None] * self.episodes.group_size, on_end)
        for index in range(self.episodes.group_size):
            self._busy(+1)
            self.queue.put_nowait((group, index))
        return group

    def failures(self) -> Failures:
        """The failures since the last call."""
        out, self._failures = self._failures, Failures()
        return out

    async def wait(self, done: Callable[[], bool], what: str) -> None:
        """Until `done()`; the engine's own failure if one comes first, RuntimeError if no work is left to wait on."""
        while True:
            if self.failure is not None:
                raise self.failure
            if done():
                return
            if self.busy == 0:  # nothing will ever change: a bug, not a wait
                raise RuntimeError(f"rollout engine stalled: {what}")
            self.changed.clear()
            await self.changed.wait()

    async def idle(self) -> None:
        """Until every group given has ended."""
        await self.wait(lambda: self.busy == 0, "work left but none playing")

    def _busy(self, change: int) -> None:
        """Count work in progress; the garbage collector is quiet while there is any (`rollout.quiet_gc`)."""
        if self.busy == 0 and change > 0:
            self._gc.enter_context(ROLLOUT_GC.quiet())
        self.busy += change
        if self.busy == 0:
            self._gc.close()
            self.changed.set()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.running_tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.running_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self.failure = task.exception()  # a bug: whoever waits raises it
            self.changed.set()

    async def _worker(self) -> None:
        while True:
            me = asyncio.current_task()
            if me is not None and me.cancelling():  # a cancel an episode swallowed (3.11's wait_for can): obey it
                raise asyncio.CancelledError
            group, index = await self.queue.get()
            self.running += 1
            try:
                traj = await self.episodes.players.play(group.task, index, group.limits, group.branches.get(index))
            finally:
                self.running -= 1
            ROLLOUT_GC.collect_if_piling_up()
            if traj.infra_error and self._again(group, index, traj):
                continue  # played again from the start, same seeds, a fresh environment; still counted busy
            group.trajs[index] = traj
            if all(t is not None for t in group.trajs):
                self._spawn(self._end(group))  # scored beside the episodes still running
            else:
                self._busy(-1)

    def _again(self, group: Group, index: int, traj: Trajectory) -> bool:
        """Count a failed episode by its type; queue it again if its server died under it, or if `on_error: retry`
        has retries left for it (module doc)."""
        if traj.server_lost:
            self._failures.replayed += 1
            self.queue.put_nowait((group, index))
            return True
        self._failures.by_type[traj.error_type or "other"] += 1
        if self.episodes.on_error != "retry" or group.retries[index] >= self.episodes.max_retries:
            return False
        group.retries[index] += 1
        self._failures.retried += 1
        self.queue.put_nowait((group, index))
        return True

    def _branch(self, group: Group) -> bool:
        """Queue the branches of a group whose own episodes have all ended, if it branches; whether it did."""
        group.branched = True
        rule, trajs = self.episodes.branching, [t for t in group.trajs if t is not None]
        plans = [] if rule is None else branches(rule, trajs)
        for k, plan in enumerate(plans, start=len(group.trajs)):
            group.branches[k] = plan
            group.trajs.append(None)
            self._busy(+1)
            self.queue.put_nowait((group, k))
        return bool(plans)

    async def _end(self, group: Group) -> None:
        """A group's episodes have all ended: its branches if it branches (then it ends again once they have), else
        its group reward, the returns, whether it is dropped, `on_end`."""
        if not group.branched and self._branch(group):
            self._busy(-1)  # the group's own count: its branches hold it open now
            return
        ep, ended = self.episodes, [t for t in group.trajs if t is not None]
        if ep.group_reward is not None:
            failed = sum(t.infra_error for t in ended)
            ended = await score_group(ep.group_reward, group.task, ended, ep.limits.env_timeout_s)
            self._failures.by_type["group_reward"] += sum(t.infra_error for t in ended) - failed
        group.ended = TrajectoryGroup(str(group.task.get("id", "")), scored(ended, ep.truncated_reward))
        # on_error keep: the episodes that did not fail train; else the group is out of the update
        group.dropped = ep.on_error != "keep" and any(t.infra_error for t in ended)
        group.on_end(group)
        self._busy(-1)
        self.changed.set()


def _nothing(group: Group) -> None:
    pass


async def play_groups(tasks: Sequence[dict[str, Any]], episodes: Episodes, max_concurrent: int = 64
                      ) -> list[TrajectoryGroup]:
    """Each task's group, played by the engine with `episodes.limits` as they are (their seed included), in task
    order once every one has ended."""
    async with Engine(episodes, max_concurrent) as engine:
        groups = [engine.play(task, episodes.limits, _nothing) for task in tasks]
        await engine.idle()
    return [g.ended for g in groups if g.ended is not None]


async def rollout_groups(tasks: Sequence[dict[str, Any]], make_env: Callable[[dict[str, Any]], Env],
                         sampler: Sampler, renderer: Renderer, limits: EpisodeLimits, group_size: int,
                         max_concurrent: int = 64, group_reward: Callable[..., Any] | None = None
                         ) -> list[TrajectoryGroup]:
    """The engine in one call, for a script of your own: `group_size` episodes of each task played in this process
    through `sampler` (`play_groups` on `rollout.players.LocalPlayers`), with `group_reward` if given."""
    players = LocalPlayers(make_env, sampler, renderer)
    return await play_groups(tasks, Episodes(players, limits, group_size, group_reward), max_concurrent)
