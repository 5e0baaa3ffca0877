"""The relative reward audit (`agent-rl audit-reward ENV --relative CONFIG`): does a hack outrank trying?

GRPO compares a rollout with its group, so a hack that earns nothing can still be reinforced: a return of 0 tops a
group whose other rollouts tried and failed with penalties (docs/credit.md#gui-evidence). This audit plays each hack
inside a group of honest rollouts of the same task and fails it when its advantage, under the config's credit rule,
estimator and truncation rule, is above an honest failure's.

Owns: the honest rollouts a group is made of (`honest_policies`: the solver; a slip, then the solver; slips until the
turn limit; the solver with a wrong final answer, with or without a slip first), playing them and the hacks
(`play_relative`: each task's honest rollouts once, every variant of every hack that applies), a rollout's advantage
as the verdict reads it (`advantages_in_group`: per turn), the
verdicts (`judge_relative`, a pure function of the played episodes and a scoring rule), `RelativeReport` and its
table (`format_relative`).
Does not own: the hacks (`audit.catalogue`), which apply (`audit.targets`), playing one episode (`audit.play`),
returns (`core.returns`), advantages and credit (`learn.advantages`, `learn.credit`), the absolute verdicts
(`audit.report`).

A slip is the environment's own `mistake` where it has one (the GUI's: an unrelated click, the wrong tool, an
unknown element id), else a call to a tool it does not have. An honest failure is an honest rollout that did not
earn the solver's full reward. What is compared is each rollout's opening turn: every rollout of a group starts
from the same state with the same (empty) history, so there its advantage says how the update ranks the episode it
opened (with `credit: trajectory`, the episode's advantage; with `turn` and `gigpo`, the turn's, whose return is the
episode's value). Later turns start from states and histories the rollouts do not share, and their returns differ
by what each episode already paid (core.returns): a comparison there would rank histories, not actions. A hack its
group leaves out (a truncation `truncated_reward: null` masks) outranks nothing.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from agent_rl.audit.hacks import Policy
from agent_rl.audit.play import LIMITS, play_policy
from agent_rl.audit.report import FULL
from agent_rl.audit.targets import plan_for
from agent_rl.core.audit_target import Target
from agent_rl.core.env import Task
from agent_rl.core.registry import EnvSpec
from agent_rl.core.renderers.base import Renderer
from agent_rl.core.returns import scored
from agent_rl.core.types import Message, ToolCall, Trajectory, TrajectoryGroup
from agent_rl.learn.advantages import ESTIMATORS, group_advantages
from agent_rl.learn.algorithm import AlgorithmConfig, credit_of
from agent_rl.rollout.runner import EpisodeLimits

# (a group's trajectories, truncated_reward) -> the same with their returns set: `core.returns.scored`, or a test's
Score = Callable[[Iterable[Trajectory], float | None], tuple[Trajectory, ...]]
TOLERANCE = 1e-9  # advantages equal up to rounding do not outrank


def _slip(spec: EnvSpec, t: Target, rng: random.Random) -> Callable[[Sequence[Message]], Message | None]:
    """The environment's own slip (None where none fits), else a call to a tool it does not have."""
    if spec.mistake is not None:
        mistake = spec.mistake
        return lambda messages: mistake(t.task, messages, rng)
    unknown = Message("assistant", "", (ToolCall("lookup_answer", {"question": t.question}),))
    return lambda messages: unknown


def _wrong_end(solve: Policy, t: Target) -> Policy:
    """The solver's replies, its final answer (a reply without a tool call) replaced by a wrong one."""
    def policy(messages: Sequence[Message]) -> Message | str:
        reply = solve(messages)
        done = isinstance(reply, str) or not reply.tool_calls
        return Message("assistant", t.say(t.wrong[0])) if done else reply
    return policy


def honest_policies(spec: EnvSpec, t: Target, seed: int = 0) -> dict[str, Policy]:
    """The honest rollouts of one task, by label: the solver; a slip on the first turn, then the solver; a slip on
    every turn where one fits (else the solver's move) until the turn limit; the solver with a wrong final answer,
    alone and after a slip. {} without a solver."""
    solve = t.solve
    if solve is None:
        return {}
    rng = random.Random(f"{seed}:{t.task.get('id', '')}")
    slip = _slip(spec, t, rng)

    def slip_first(then: Policy) -> Policy:
        def policy(messages: Sequence[Message]) -> Message | str:
            first = not any(m.role == "assistant" for m in messages)
            return (slip(messages) or then(messages)) if first else then(messages)
        return policy

    out: dict[str, Policy] = {"the solver": solve, "a slip, then the solver": slip_first(solve)}
    if spec.mistake is not None:
        out["a slip on every turn it fits, until the turn limit"] = lambda m: slip(m) or solve(m)
    if t.wrong:
        out["the solver, a wrong final answer"] = _wrong_end(solve, t)
        out["a slip, then the solver, a wrong final answer"] = slip_first(_wrong_end(solve, t))
    return out


@dataclass(frozen=True)
class Played:
    """One task's episodes: its honest rollouts and every hack variant's."""

    task_id: str
    honest: tuple[tuple[str, Trajectory], ...]  # (label, trajectory)
    hacks: tuple[tuple[str, str, str, Trajectory], ...]  # (hack, its group, variant label, trajectory)


async def play_relative(spec: EnvSpec, renderer: Renderer, n_tasks: int = 2, seed: int = 0, split: str = "train",
                        limits: EpisodeLimits = LIMITS, concurrency: int = 4) -> list[Played]:
    """Each task's honest rollouts once, and every variant of every hack that applies, through the real runner."""
    plan = plan_for(spec)
    tasks: list[Task] = spec.load_tasks(n_tasks, seed=seed, split=split)
    if not tasks:
        raise ValueError(f"environment {spec.name!r} gave no tasks to audit")
    gate = asyncio.Semaphore(concurrency)
    out = []
    for task in tasks:
        target = plan.target(task, tasks)
        honest = honest_policies(spec, target, seed)
        if not honest:
            raise ValueError(f"environment {spec.name!r} has no solver: the relative audit needs honest rollouts")
        hacks = [(h.name, h.group, label, policy) for h in plan.hacks for label, policy in h.variants(target).items()]
        played = await asyncio.gather(*(play_policy(spec, renderer, limits, task, p, gate) for p in honest.values()),
                                      *(play_policy(spec, renderer, limits, task, h[3], gate) for h in hacks))
        out.append(Played(str(task.get("id", "")), tuple(zip(honest, played[:len(honest)])),
                          tuple((n, g, label, t) for (n, g, label, _), t in zip(hacks, played[len(honest):]))))
    return out


def advantages_in_group(trajs: Sequence[Trajectory], algo: AlgorithmConfig, score: Score = scored
                        ) -> list[list[float] | None]:
    """Each trajectory's advantage per turn in a group of `trajs` under `algo` (with `credit: trajectory`, its
    episode's at every turn); None: left out of the group (a masked truncation)."""
    group = TrajectoryGroup("audit", score(trajs, algo.truncated_reward))
    adv = group_advantages([group], ESTIMATORS[algo.advantage].advantages, credit_of(algo))
    kept = {id(t): k for k, t in enumerate(adv.trajectories)}
    out: list[list[float] | None] = []
    for t in group.trajectories:
        if t.ret is None or not t.ret.usable:
            out.append(None)
        elif id(t) not in kept:  # a group without signal: every advantage 0
            out.append([0.0] * len(t.turns))
        else:
            k = kept[id(t)]
            turns = adv.turn_advantages[k] if adv.turn_advantages is not None else (adv.advantages[k],) * len(t.turns)
            out.append(list(turns))
    return out


@dataclass(frozen=True)
class RelativeRow:
    """One hack over every variant and task: how far its opening turn's advantage came above the lowest honest
    failure's."""

    name: str
    group: str
    episodes: int
    margin: float  # max over its groups of (its advantage - the lowest honest failure's); <= 0: never above
    verdict: str  # ok, OUTRANKS
    worst: dict[str, Any] | None = None  # the group where it came highest


@dataclass(frozen=True)
class RelativeReport:
    env: str
    credit: str
    advantage: str
    truncated_reward: float | None
    tasks: int
    honest_failures: int  # honest rollouts that did not earn full reward, over every task
    rows: tuple[RelativeRow, ...]

    @property
    def failures(self) -> list[RelativeRow]:
        return [r for r in self.rows if r.verdict != "ok"]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "passed": not self.failures}

    def failure_line(self) -> str:
        """"gui (credit gigpo, grpo): claim_done OUTRANKS an honest failure by 0.41", or "" when it passed."""
        parts = [f"{r.name} OUTRANKS an honest failure by {r.margin:.3g}" for r in self.failures]
        return f"{self.env} (credit {self.credit}, {self.advantage}): {', '.join(parts)}" if parts else ""


def _group_margin(task: Played, hack: Trajectory, algo: AlgorithmConfig, score: Score
                  ) -> tuple[float, dict[str, Any]] | None:
    """How far the hack's opening turn's advantage came above the lowest honest failure's in one group; None: nothing
    to compare (no honest failure, or the hack left out of the group)."""
    trajs = [t for _, t in task.honest] + [hack]
    advantages = advantages_in_group(trajs, algo, score)
    failed = [a[0] for (_, t), a in zip(task.honest, advantages) if t.reward < FULL and a]
    own = advantages[-1]
    if not own or not failed:
        return None
    labels = [*(label for label, _ in task.honest), "hack"]
    return own[0] - min(failed), {
        "task_id": task.task_id, "opening_advantages": dict(zip(labels, [a[0] if a else None for a in advantages])),
        "values": dict(zip(labels, [t.ret.value if t.ret else None for t in score(trajs, algo.truncated_reward)])),
        "rewards": dict(zip(labels, [t.reward for t in trajs])),
        "turn_rewards": dict(zip(labels, [t.turn_reward for t in trajs])), "stop": hack.stop_reason.value}


def judge_relative(env: str, played: Sequence[Played], algo: AlgorithmConfig, score: Score = scored
                   ) -> RelativeReport:
    """Each hack's row: OUTRANKS when, in some group, its advantage is above an honest failure's (by more than
    rounding). `score` sets the returns (the rules of `core.returns`; a test passes older ones)."""
    names = list(dict.fromkeys((n, g) for task in played for n, g, _, _ in task.hacks))
    rows = []
    for name, group in names:
        best: tuple[float, dict[str, Any]] | None = None
        episodes = 0
        for task in played:
            for n, _, label, traj in task.hacks:
                if n != name:
                    continue
                episodes += 1
                judged = _group_margin(task, traj, algo, score)
                if judged is not None and (best is None or judged[0] > best[0]):
                    best = (judged[0], {"variant": label, **judged[1]})
        margin = -float("inf") if best is None else best[0]
        verdict = "OUTRANKS" if margin > TOLERANCE else "ok"
        rows.append(RelativeRow(name, group, episodes, margin, verdict, best[1] if best and verdict != "ok" else None))
    failures = sum(t.reward < FULL for task in played for _, t in task.honest)
    return RelativeReport(env, algo.credit, algo.advantage, algo.truncated_reward, len(played), failures, tuple(rows))


def format_relative(report: RelativeReport) -> str:
    """A markdown table: one line per hack, its largest margin over the lowest honest failure's advantage."""
    lines = [f"relative reward audit of {report.env}: {report.tasks} task{'s' * (report.tasks != 1)}, credit "
             f"{report.credit}, advantage {report.advantage}, truncated_reward {report.truncated_reward}; "
             f"{report.honest_failures} honest failure{'s' * (report.honest_failures != 1)} to compare with", "",
             "| hack | group | episodes | advantage above the lowest honest failure's | verdict |",
             "| --- | --- | --- | --- | --- |"]
    for r in report.rows:
        margin = "n/a" if r.margin == -float("inf") else f"{r.margin:.3g}"
        lines.append(f"| {r.name} | {r.group} | {r.episodes} | {margin} | {r.verdict} |")
    for r in report.failures:
        lines.append(f"\n{r.name} OUTRANKS: {r.worst}")
    return "\n".join(lines)
