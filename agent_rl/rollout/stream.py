"""The rollout stream: a training run's groups played all the time on the rollout engine, each step's batch handed
over as soon as the staleness bound allows.

Owns: `TaskStream` (the run's tasks in a fixed order, and a position); `RolloutStream`: the slots that
`rollout.admission` opens as weight pushes come in, each given the next task and played as a group by the engine
(`rollout.engine`) with its wave's seeds; refills (a group without signal, under dynamic sampling, or lost whole to
infrastructure errors, gives its slot to the next task, up to `algorithm.max_resample_batches` times); `batch(step)`
(waits for what `Admission.choose` needs), `pushed(version)`; what a checkpoint keeps (`state`); and the stream's
figures (time waited, the servers' idle share, episodes in flight, groups buffered and dropped).
Does not own: playing a group, its failure policy and failure counts (`rollout.engine`), one episode
(`rollout.runner`), the staleness rule (`rollout.admission`), whether a group has signal (the caller's predicate,
`learn.advantages.has_signal`), the training loop (`trainer`).

Waves. The groups started together form a wave labelled (target step, round): the B slots of a target open
together as round 0; once every group of wave (t, r) has ended, those to refill take the next tasks, in
slot order, as wave (t, r + 1). The label seeds the wave's requests, `step_seed(run seed, t, r)`, then
`request_seed` per task, rollout and turn (`core.seeds`): at k = 0 the synchronous loop's step and round. A batch
lists its groups in task order, as the synchronous loop did.

Resume. A checkpoint holds the task position and, for each slot not yet trained, its group's round and
task position (`state`). A resumed stream plays those groups again from their start, same tasks and
seeds: no task is skipped and none is trained twice.
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from agent_rl.core.seeds import step_seed
from agent_rl.core.types import TrajectoryGroup
from agent_rl.rollout.admission import Admission, StaleCheckpoint
from agent_rl.rollout.engine import Engine, Episodes, Failures, Group
from agent_rl.rollout.players import loop_time


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


def resumable(saved: Any) -> dict[str, Any]:
    """A checkpoint's stream state (`RolloutStream.state`), or `StaleCheckpoint`'s one line for one written before
    agent-rl 0.1.0 (a bare task position, or slots without the version each opened at)."""
    if not isinstance(saved, dict) or "groups" not in saved or "position" not in saved:
        raise StaleCheckpoint("its stream state is a task position, not the stream's open slots")
    Admission.from_json(saved, 1, 0, 0)  # the slots' form alone is checked here; the shape is the run's
    return saved


@dataclass(eq=False)
class _Slot:
    """A slot's current group: which slot, its wave's label, its task's position, and what it is waiting for."""

    slot: int
    label: tuple[int, int]  # (target step, round)
    position: int  # of its task in the TaskStream
    group: Group | None = None  # the engine's, once given to it
    refill: bool | None = None  # None while playing or scoring
    wave: list[_Slot] = field(default_factory=list)  # the slots started with it: its refill waits for them


@dataclass(frozen=True)
class Batch:
    """What a step takes from the stream: its groups in task order, the failures since the last batch (typed: the
    run's stopping decides from them), and the stream's own figures."""

    groups: list[TrajectoryGroup]
    failures: Failures
    metrics: dict[str, float]


class RolloutStream:
    """Group slots played continuously; `batch(step)` hands a step its groups (module doc).

        async with RolloutStream(tasks, episodes, admission, run_seed=0, max_concurrent=64) as stream:
            stream.start(version)          # the slots the starting version opens (or a checkpoint's)
            batch = await stream.batch(step)
            ... train, push ...
            stream.pushed(step + 1)
    """

    def __init__(self, tasks: TaskStream, episodes: Episodes, admission: Admission, *, run_seed: int,
                 max_concurrent: int, max_rounds: int = 0, signal: Callable[[TrajectoryGroup], bool] | None = None):
        self.tasks, self.episodes, self.admission = tasks, episodes, admission
        self.run_seed, self.max_rounds, self.signal = run_seed, max_rounds, signal
        self.engine = Engine(episodes, max_concurrent)
        self.slots: dict[int, _Slot] = {}  # open slot -> its current group

    async def __aenter__(self) -> RolloutStream:
        await self.engine.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.engine.__aexit__(*exc)

    @property
    def in_flight(self) -> int:
        """Episodes being played now."""
        return self.engine.running

    def start(self, version: int, saved: dict[str, Any] | None = None) -> None:
        """Play the groups a checkpoint's `state` left open (none on a fresh run), then open what `version` allows."""
        self.episodes.players.idle_share()  # the first step's share counts from here
        if saved is not None:
            self.tasks.position = int(saved["position"])
            waves: dict[tuple[int, int], list[_Slot]] = defaultdict(list)
            for slot, round_, position in saved["groups"]:
                label = (self.admission.target(slot), round_)
                waves[label].append(self._slot(slot, label, position))
            for wave in waves.values():
                self._play(wave)
        self.pushed(version)

    def pushed(self, version: int) -> None:
        """The servers sample with `version` now: open the slots it allows, each target's as one wave."""
        waves: dict[int, list[_Slot]] = defaultdict(list)
        for slot in self.admission.open_up_to(version):
            target = self.admission.target(slot)
            waves[target].append(self._slot(slot, (target, 0), self.tasks.position))
            self.tasks.position += 1
        for wave in waves.values():
            self._play(wave)

    async def batch(self, step: int) -> Batch:
        """Step `step`'s groups, in task order, once `Admission.choose` allows; the failures; the stream's figures."""
        t0 = loop_time()
        chosen: list[int] | None = None

        def ready() -> bool:
            nonlocal chosen
            chosen = self.admission.choose(step, [s.slot for s in self.slots.values() if s.refill is False])
            return chosen is not None

        await self.engine.wait(ready, f"at step {step}: slots {sorted(self.slots)} open, none playing "
                                      f"(was `pushed` called after each push?)")
        assert chosen is not None
        buffered = sum(s.refill is False for s in self.slots.values()) - len(chosen)
        self.admission.take(chosen)
        mine = sorted((self.slots.pop(n) for n in chosen), key=lambda s: s.position)
        groups = [s.group for s in mine if s.group is not None]
        metrics = {"time/wait_s": loop_time() - t0,
                   "resample_batches": float(max((s.label[1] for s in mine), default=0)),
                   "server_idle_share": self.episodes.players.idle_share(), "stream/buffered": float(buffered),
                   "stream/open_slots": float(len(self.slots)),
                   "error/dropped_groups": float(sum(g.dropped for g in groups))}
        return Batch([g.ended for g in groups if g.ended is not None and not g.dropped], self.engine.failures(),
                     metrics)

    def data_position(self) -> int:
        """Every task before this position has been trained or tried: where the synchronous loop would resume."""
        return min((s.position for s in self.slots.values()), default=self.tasks.position)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (JSON): the task position, the slots, each open slot's group (round, task)."""
        slots = sorted(self.slots.values(), key=lambda s: s.slot)
        return {"position": self.tasks.position, **self.admission.to_json(),
                "groups": [[s.slot, s.label[1], s.position] for s in slots]}

    # -- playing -------------------------------------------------------------------------------------------

    def _slot(self, slot: int, label: tuple[int, int], position: int) -> _Slot:
        self.slots[slot] = _Slot(slot, label, position)
        return self.slots[slot]

    def _play(self, wave: list[_Slot]) -> None:
        """Give each slot's group to the engine, its requests seeded by the wave's label."""
        limits = replace(self.episodes.limits, seed=step_seed(self.run_seed, *wave[0].label))
        for s in wave:
            s.wave = wave
            s.group = self.engine.play(self.tasks.at(s.position), limits, functools.partial(self._ended, s))

    def _ended(self, s: _Slot, group: Group) -> None:
        """A slot's group has ended (scored): whether it keeps its slot; once its whole wave has, the refills."""
        assert group.ended is not None
        trajs = group.ended.trajectories
        s.refill = s.label[1] < self.max_rounds and (
            group.dropped or all(t.infra_error for t in trajs)
            or (self.signal is not None and not self.signal(group.ended)))
        if all(w.refill is not None for w in s.wave):
            target, round_ = s.label
            refills = [self._slot(w.slot, (target, round_ + 1), self.tasks.position + i)
                       for i, w in enumerate(sorted((w for w in s.wave if w.refill), key=lambda w: w.slot))]
            self.tasks.position += len(refills)
            if refills:
                self._play(refills)
