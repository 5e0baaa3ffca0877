"""The reward audit (`agent-rl audit-reward ENV`): play known reward hacks through the real runner and
fail loudly if any of them earns reward, or if the scripted solver does not earn full reward.

Owns: `audit_env`: every hack that applies (`audit.targets.plan_for`), in each of its variants, on
a fixed sample of tasks, played by a `ScriptedSampler` through `rollout.runner`, as rollouts are;
then the environment's solver on the same tasks; the episode limits of the audit (`LIMITS`).
Does not own: the hacks (`audit.hacks`), which apply where (each environment's spec, `audit.targets`),
the verdicts and tables (`audit.report`), the environments and their rewards.
"""

from __future__ import annotations

import asyncio
import time

from agent_rl.audit.hacks import Policy
from agent_rl.audit.report import AuditReport, judge
from agent_rl.audit.targets import plan_for
from agent_rl.core.env import Task
from agent_rl.core.registry import EnvSpec
from agent_rl.core.renderers.base import Renderer
from agent_rl.core.types import Trajectory
from agent_rl.rollout.engine import Episodes, play_groups
from agent_rl.rollout.players import LocalPlayers
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.rollout.scripted import ScriptedSampler

# room for the GUI solver's longest task (scrolls, three changes, Save, done) and a 250-name listing
LIMITS = EpisodeLimits(max_turns=10, max_tokens_per_turn=1024, max_total_tokens=12288)


async def play_policy(spec: EnvSpec, renderer: Renderer, limits: EpisodeLimits, task: Task, policy: Policy,
                gate: asyncio.Semaphore) -> Trajectory:
    """One episode of `task` with `policy` playing the policy's part, through the real runner (at most as many at once
    as `gate` lets in)."""
    async with gate:
        sampler = ScriptedSampler(renderer, policy, logprob=0.0, on_messages=True)
        [group] = await play_groups([task], Episodes(LocalPlayers(spec.make_env, sampler, renderer), limits, 1))
        return group.trajectories[0]


async def _check_env_starts(spec: EnvSpec, task: Task) -> None:
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
    plan = plan_for(spec)
    try:
        tasks = spec.load_tasks(n_tasks, seed=seed, split=split)
    except Exception as e:
        raise ValueError(f"environment {spec.name!r} could not load tasks: {type(e).__name__}: {e}") from None
    if not tasks:
        raise ValueError(f"environment {spec.name!r} gave no tasks to audit")
    targets = [plan.target(task, tasks) for task in tasks]
    await _check_env_starts(spec, tasks[0])
    gate = asyncio.Semaphore(concurrency)
    jobs: list[tuple[str, str]] = []  # (hack name, variant label) per coroutine
    coroutines = []
    for hack in plan.hacks:
        for target in targets:
            for label, policy in hack.variants(target).items():
                jobs.append((hack.name, label))
                coroutines.append(play_policy(spec, renderer, limits, target.task, policy, gate))
    for target in targets:
        if target.solve is not None:  # the spec's solver, bound to the task (`audit.targets`)
            jobs.append(("solver", "solve"))
            coroutines.append(play_policy(spec, renderer, limits, target.task, target.solve, gate))
    played = await asyncio.gather(*coroutines)
    rows = []
    for hack in plan.hacks:
        mine = [(label, t) for (name, label), t in zip(jobs, played) if name == hack.name]
        if mine:
            rows.append(judge(hack.name, hack.group, hack.what, mine))
    solved = [(label, t) for (name, label), t in zip(jobs, played) if name == "solver"]
    if solved:
        rows.append(judge("solver", "solver", "the environment's scripted solver", solved, solver=True))
    return AuditReport(spec.name, len(tasks), seed, split, round(time.monotonic() - start, 1), tuple(rows))
