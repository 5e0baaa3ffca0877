"""Several environments in one run: a weighted mixture that looks like one environment.

Owns: `Mixture` (its `as_spec()` is an `EnvSpec`, so every command plays a mixture as it plays one
environment): which environment each task slot draws from (`schedule`), the mixture's tasks tagged
with the name of the environment they came from (`task["env"]`, which `rollout.runner` copies into
`Trajectory.env` for per-environment metrics), and handing `make_env`, `solve` and `group_reward` to
that environment, which sees its task untagged, exactly as in a run of its own; `load_mixture`.
Does not own: finding environments by name (`core.registry`), the order in which a run consumes the
tasks and its saved position (`rollout.stream.TaskStream`): a mixture's tasks are one list in slot
order, so a checkpoint's position stays one number and every environment's own position follows from it.

The schedule is smooth weighted round-robin: deterministic, and every prefix of it holds each
environment in proportion to its weight to within one task, so a step of 2 tasks from environments
weighted 1:1 has one of each, and a resumed run draws exactly the slots the first one would have.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_rl.core.env import Env, Task
from agent_rl.core.registry import EnvSpec, load_env
from agent_rl.core.types import Message

ENV_KEY = "env"  # the tag a mixture adds to each task: the name of the environment it came from


def env_label(name: str) -> str:
    """What a mixture calls an environment (in tasks, metrics and reports): a .py path's file stem."""
    return Path(name).stem if name.endswith(".py") else name


def schedule(weights: Sequence[float], n: int) -> list[int]:
    """The environment (an index into `weights`) of each of the first `n` task slots."""
    total, credit, out = sum(weights), [0.0] * len(weights), []
    for _ in range(n):
        credit = [c + w for c, w in zip(credit, weights)]
        pick = max(range(len(weights)), key=credit.__getitem__)  # the first of equals: deterministic
        credit[pick] -= total
        out.append(pick)
    return out


def untagged(task: Task) -> Task:
    return {k: v for k, v in task.items() if k != ENV_KEY}


@dataclass(frozen=True)
class Mixture:
    specs: tuple[EnvSpec, ...]
    weights: tuple[float, ...]
    labels: tuple[str, ...]

    @property
    def name(self) -> str:
        return " + ".join(f"{label} x{w:g}" for label, w in zip(self.labels, self.weights))

    def spec_of(self, task: Task) -> EnvSpec:
        label = task.get(ENV_KEY)
        if label not in self.labels:
            raise ValueError(f"task {task.get('id')!r} names no environment of the mixture {self.name} "
                             f"(its {ENV_KEY!r} is {label!r})")
        return self.specs[self.labels.index(label)]

    def load_tasks(self, n: int, seed: int = 0, split: str = "train") -> list[Task]:
        """`n` tasks in slot order, each environment's own tasks in its own order, tagged with its name."""
        slots = schedule(self.weights, n)
        rows = {i: self._rows(i, count, seed, split) for i, count in Counter(slots).items()}
        taken: Counter[int] = Counter()
        out = []
        for i in slots:
            out.append({**rows[i][taken[i] % len(rows[i])], ENV_KEY: self.labels[i]})
            taken[i] += 1
        return out

    def _rows(self, i: int, count: int, seed: int, split: str) -> list[Task]:
        label = self.labels[i]
        rows = self.specs[i].load_tasks(count, seed=seed, split=split)
        if not rows:
            raise ValueError(f"environment {label!r} of the mixture gave no {split} tasks")
        if any(ENV_KEY in r for r in rows):
            raise ValueError(f"environment {label!r}: its tasks have an {ENV_KEY!r} column, which a mixture "
                             f"uses to tell environments apart; rename it to mix this environment")
        return rows

    def make_env(self, task: Task) -> Env:
        return self.spec_of(task).make_env(untagged(task))

    def solve(self, task: Task, messages: Sequence[Message], direct: bool) -> Message:
        spec = self.spec_of(task)
        assert spec.solve is not None  # as_spec offers solve only when every environment has one
        return spec.solve(untagged(task), messages, direct)

    def mistake(self, task: Task, messages: Sequence[Message], rng: Any) -> Message | None:
        """The task's environment's mistake; None (no mistake fits) where it has none."""
        hook = self.spec_of(task).mistake
        return None if hook is None else hook(untagged(task), messages, rng)

    async def group_reward(self, task: Task, trajectories: Sequence[Any]) -> Any:
        """The group reward of the task's environment; None (nothing added) where it has none."""
        hook = self.spec_of(task).group_reward
        if hook is None:
            return None
        out = hook(untagged(task), trajectories)
        return await out if inspect.isawaitable(out) else out

    def as_spec(self) -> EnvSpec:
        return EnvSpec(self.name, self.make_env, self.load_tasks,
                       solve=self.solve if all(s.solve for s in self.specs) else None,
                       group_reward=self.group_reward if any(s.group_reward for s in self.specs) else None,
                       mistake=self.mistake if any(s.mistake for s in self.specs) else None)


def load_mixture(entries: Sequence[tuple[str, float]], args: Sequence[dict[str, Any]] = ()) -> EnvSpec:
    """The environments `entries` names, (name, weight > 0) each, as one `EnvSpec`, with `args[i]` bound
    into the i-th one's `load_tasks` (`EnvSpec.with_task_args`); a bad name or argument fails here."""
    labels = [env_label(name) for name, _ in entries]
    if dup := sorted({label for label in labels if labels.count(label) > 1}):
        raise ValueError(f"the mixture names {', '.join(dup)} twice (environments are told apart by module "
                         f"or file name)")
    if not entries or any(w <= 0 for _, w in entries):
        raise ValueError(f"a mixture needs environments with weights > 0 (got {list(entries)})")
    args = list(args) + [{}] * (len(entries) - len(args))
    specs = tuple(load_env(name).with_task_args(a) for (name, _), a in zip(entries, args))
    return Mixture(specs, tuple(float(w) for _, w in entries), tuple(labels)).as_spec()
