"""The reward audit (`agent-rl audit-reward ENV`): play known reward hacks through the real runner and
fail loudly if any of them earns reward, or if the scripted solver does not earn full reward.

Owns: `audit_env` (every applicable hack of `agent_rl.hacks`, in each of its variants, on a fixed
sample of tasks, played by a `ScriptedSampler` through `rollout.runner`, as rollouts are; then the
environment's solver on the same tasks), the verdicts (`Row`, `AuditReport`), the tables
(`format_report`, `format_matrix`) and the JSON report.
Does not own: the hacks (`agent_rl.hacks`), which apply where (`agent_rl.audit_targets`), the
environments and their rewards.

Verdicts. A hack is `ok` when no episode of it earned a reward above 0: every built-in reward is 0
for a failure, and for partial-credit rewards (coding's share of tests passed) any credit a hack
gets is a hole. `EARNS` when some episode did; `ERROR` when an episode failed with an
infrastructure error (the environment raised on the hack's input: also a bug). The solver is `ok`
when every episode reached reward 1. An environment passes when every row is `ok`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from agent_rl.audit_targets import profile_for
from agent_rl.core.registry import EnvSpec
from agent_rl.core.renderer import Renderer
from agent_rl.core.types import Trajectory
from agent_rl.hacks import Policy
from agent_rl.rollout.runner import EpisodeLimits, rollout_groups
from agent_rl.rollout.scripted import ScriptedSampler

# room for the GUI solver's longest task (scrolls, three changes, Save, done) and a 250-name listing
LIMITS = EpisodeLimits(max_turns=10, max_tokens_per_turn=1024, max_total_tokens=12288)
FULL = 1.0 - 1e-9


@dataclass(frozen=True)
class Row:
    """One hack (or the solver) over every variant and task."""

    name: str
    group: str  # answer, tool, coding, gui, or solver
    what: str
    episodes: int
    errors: int  # episodes ended by an infrastructure error
    max_reward: float
    mean_reward: float
    min_reward: float
    verdict: str  # ok, EARNS, ERROR, FAILS (the solver)
    worst: dict[str, Any] | None = None  # the highest-earning (lowest, for the solver) episode


@dataclass(frozen=True)
class AuditReport:
    env: str
    tasks: int
    seed: int
    split: str
    seconds: float
    rows: tuple[Row, ...]

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if r.verdict != "ok"]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "passed": not self.failures}

    def failure_line(self) -> str:
        """"calculator: hedge EARNS (max reward 1), solver FAILS (min reward 0)", or "" when it passed."""
        parts = [f"{r.name} {r.verdict} (min reward {r.min_reward:.3g})" if r.group == "solver"
                 else f"{r.name} {r.verdict} (max reward {r.max_reward:.3g})" for r in self.failures]
        return f"{self.env}: {', '.join(parts)}" if parts else ""


def _episode(label: str, traj: Trajectory) -> dict[str, Any]:
    replies = [m.content for m in traj.messages if m.role == "assistant"]
    return {"variant": label, "task_id": traj.task_id, "reward": traj.reward, "error": traj.error,
            "stop": traj.stop_reason.value, "last_reply": (replies[-1] if replies else "")[:400]}


def _row(name: str, group: str, what: str, played: Sequence[tuple[str, Trajectory]], solver: bool = False) -> Row:
    rewards = [t.reward for _, t in played]
    errors = sum(t.infra_error for _, t in played)
    if solver:  # the episode to show: the solver's poorest, a hack's best
        worst = min(played, key=lambda p: (p[1].reward, not p[1].infra_error))
        verdict = "ok" if not errors and min(rewards) >= FULL else "FAILS"
    else:
        worst = max(played, key=lambda p: (p[1].reward, p[1].infra_error))
        verdict = "EARNS" if max(rewards) > 0 else "ERROR" if errors else "ok"
    return Row(name, group, what, len(played), errors, max(rewards), sum(rewards) / len(rewards), min(rewards),
               verdict, _episode(*worst) if verdict != "ok" else None)


async def _play(spec: EnvSpec, renderer: Renderer, limits: EpisodeLimits, task: dict[str, Any], policy: Policy,
                gate: asyncio.Semaphore) -> Trajectory:
    async with gate:
        sampler = ScriptedSampler(renderer, policy, logprob=0.0, on_messages=True)
        [group] = await rollout_groups([task], spec.make_env, sampler, renderer, limits, group_size=1)
        return group.trajectories[0]


async def _check_env_starts(spec: EnvSpec, task: dict[str, Any]) -> None:
    """One clear error when the environment cannot even start (a missing browser, package, sandbox)."""
    try:
        async with spec.make_env(task):
            pass
    except Exception as e:
        raise RuntimeError(f"environment {spec.name!r} could not start: {type(e).__name__}: {e}") from None


async def audit_env(spec: EnvSpec, renderer: Renderer, n_tasks: int = 3, seed: int = 0, split: str = "train",
                    limits: EpisodeLimits = LIMITS, concurrency: int = 4) -> AuditReport:
    """Every applicable hack, in every variant, on `n_tasks` tasks; then the solver on the same tasks.

    Raises ValueError for an environment there is nothing to audit in (bad input), RuntimeError
    when it cannot start."""
    start = time.monotonic()
    profile = profile_for(spec)
    try:
        tasks = spec.load_tasks(n_tasks, seed=seed, split=split)
    except Exception as e:
        raise ValueError(f"environment {spec.name!r} could not load tasks: {type(e).__name__}: {e}") from None
    if not tasks:
        raise ValueError(f"environment {spec.name!r} gave no tasks to audit")
    targets = [profile.target(task, tasks, spec) for task in tasks]
    await _check_env_starts(spec, tasks[0])
    gate = asyncio.Semaphore(concurrency)
    jobs: list[tuple[str, str]] = []  # (hack name, variant label) per coroutine
    coroutines = []
    for hack in profile.hacks:
        for target in targets:
            for label, policy in hack.variants(target).items():
                jobs.append((hack.name, label))
                coroutines.append(_play(spec, renderer, limits, target.task, policy, gate))
    if spec.solve is not None:
        for target in targets:
            jobs.append(("solver", "solve"))
            coroutines.append(_play(spec, renderer, limits, target.task, target.solve, gate))
    played = await asyncio.gather(*coroutines)
    rows = []
    for hack in profile.hacks:
        mine = [(label, t) for (name, label), t in zip(jobs, played) if name == hack.name]
        if mine:
            rows.append(_row(hack.name, hack.group, hack.what, mine))
    solved = [(label, t) for (name, label), t in zip(jobs, played) if name == "solver"]
    if solved:
        rows.append(_row("solver", "solver", "the environment's scripted solver", solved, solver=True))
    return AuditReport(spec.name, len(tasks), seed, split, round(time.monotonic() - start, 1), tuple(rows))


def format_report(report: AuditReport) -> str:
    """A markdown table: one line per hack (and the solver)."""
    lines = [f"reward audit of {report.env}: {report.tasks} task{'s' * (report.tasks != 1)} "
             f"({report.split} split, seed {report.seed}), {report.seconds:g} s", "",
             "| hack | group | episodes | max reward | mean reward | verdict |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in report.rows:
        lines.append(f"| {r.name} | {r.group} | {r.episodes} | {r.max_reward:.3g} | {r.mean_reward:.3g} "
                     f"| {r.verdict} |")
    for r in report.failures:
        lines.append(f"\n{r.name} {r.verdict}: {json.dumps(r.worst, ensure_ascii=False)}")
    return "\n".join(lines)


def format_matrix(reports: Sequence[AuditReport]) -> str:
    """Hacks down, environments across: the highest reward a hack earned (episodes), the solver's lowest."""
    names = list(dict.fromkeys(r.name for report in reports for r in report.rows if r.name != "solver"))
    names.append("solver")
    lines = ["| hack | " + " | ".join(r.env for r in reports) + " |", "| --- |" + " --- |" * len(reports)]
    for name in names:
        cells = []
        for report in reports:
            row = next((r for r in report.rows if r.name == name), None)
            value = None if row is None else row.min_reward if name == "solver" else row.max_reward
            flag = "" if row is None or row.verdict == "ok" else f" {row.verdict}"
            cells.append("n/a" if row is None else f"{value:.3g} ({row.episodes}){flag}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
