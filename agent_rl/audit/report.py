"""The reward audit's verdicts and tables.

Owns: `Row` (one hack, or the solver, over every variant and task) and its verdict (`judge`),
`AuditReport` (one environment's rows; its JSON and its failure line), the tables (`format_report`,
`format_matrix`).
Does not own: the hacks (`audit.hacks`), playing them (`audit.play`).

Verdicts. An episode's reward here is its return: the outcome plus the turns' own rewards (those are 0
unless the environment's turn rewards are on, `agent-rl audit-reward ENV --env-arg turn_rewards=true`).
A hack is `ok` when no episode of it earned a return above 0: every built-in reward is 0 for a failure,
for partial-credit rewards (coding's share of tests passed) any credit a hack gets is a hole, and
turn rewards that a hack could collect without solving the task would be one too. `EARNS` when some
episode did; `ERROR` when an episode failed with an infrastructure error (the environment raised on
the hack's input: also a bug). The solver is `ok` when every episode's return reached 1. An
environment passes when every row is `ok`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from agent_rl.core.types import Trajectory

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


def episode_return(traj: Trajectory) -> float:
    """The outcome plus the turns' own rewards: what a hack must not raise above 0."""
    return traj.reward + traj.turn_reward


def _episode(label: str, traj: Trajectory) -> dict[str, Any]:
    replies = [m.content for m in traj.messages if m.role == "assistant"]
    return {"variant": label, "task_id": traj.task_id, "reward": traj.reward, "turn_reward": traj.turn_reward,
            "error": traj.error, "stop": traj.stop_reason.value, "last_reply": (replies[-1] if replies else "")[:400]}


def judge(name: str, group: str, what: str, played: Sequence[tuple[str, Trajectory]], solver: bool = False) -> Row:
    """The row of a hack (or, with `solver`, of the solver) from its episodes, (variant label, trajectory) each."""
    rewards = [episode_return(t) for _, t in played]
    errors = sum(t.infra_error for _, t in played)
    if solver:  # the episode to show: the solver's poorest, a hack's best
        worst = min(played, key=lambda p: (episode_return(p[1]), not p[1].infra_error))
        verdict = "ok" if not errors and min(rewards) >= FULL else "FAILS"
    else:
        worst = max(played, key=lambda p: (episode_return(p[1]), p[1].infra_error))
        verdict = "EARNS" if max(rewards) > 0 else "ERROR" if errors else "ok"
    return Row(name, group, what, len(played), errors, max(rewards), sum(rewards) / len(rewards), min(rewards),
               verdict, _episode(*worst) if verdict != "ok" else None)


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
