"""Held-out evaluation: accuracy, pass@k and tool use of one or more policies on the same tasks.

Owns: `eval_report` (a pure function from rollout groups to figures, and the same figures per
environment, `env/<name>/...`, when the tasks came from a mixture of several), `pass_at_k` (the unbiased
estimator of Chen et al. 2021) and `pass_hat_k` (tau-bench's pass^k: all k right), `pass_figures`,
`resolve_policy` (what a user may point `--adapter` at: the base model, a LoRA adapter, or the full weights
of a full fine-tune), `play_policies` (serve each policy, play the tasks, on rollout workers with
`rollout.workers`; also what the BFCL benchmark plays with), `evaluate` (play the held-out tasks, report; two
adapters side by side) and `env_verdict` (the verdict kept with an episode's replies).
Does not own: playing episodes (`rollout.runner`), behavioural rates (`runs.metrics`), servers, the table a
person reads (`runs.summary`).

Fair comparisons: every policy plays the same tasks with the same per-request sampling seeds, so
two adapters differ only by their weights (common random numbers), not by the luck of the draw.
"""

from __future__ import annotations

import math
import os
import secrets
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

from agent_rl.core.types import Trajectory, TrajectoryGroup
from agent_rl.rollout.engine import play_groups
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.rollout.serving.choose import serving_backend
from agent_rl.rollout.weight_sync.adapter import AdapterSync
from agent_rl.rollout.workers import ray_cluster
from agent_rl.runs.metrics import ENV_FIGURES, rollout_metrics, tool_decision_metrics, violation_metrics
from agent_rl.session import Session, episodes, with_workers

BASE = "base"


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k draws without replacement from n samples, c of them correct, is correct)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """pass^k (tau-bench): P(all of k draws without replacement from n samples, c of them correct, are correct)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass^k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    return math.comb(c, k) / math.comb(n, k)


def pass_figures(counts: Sequence[tuple[int, int]], ks: Sequence[int]) -> dict[str, float]:
    """`pass@k` and `pass^k` for each k, averaged over the tasks `(n, c)` (samples, correct) with n >= k
    (0.0 when none has)."""
    out = {}
    for k in ks:
        done = [(n, c) for n, c in counts if n >= k]
        out[f"pass@{k}"] = fmean(pass_at_k(n, c, k) for n, c in done) if done else 0.0
        out[f"pass^{k}"] = fmean(pass_hat_k(n, c, k) for n, c in done) if done else 0.0
    return out


def eval_report(groups: Sequence[TrajectoryGroup], success_threshold: float = 1.0,
                calls_in_reasoning: Callable[[str], int] = lambda text: 0) -> dict[str, float]:
    """Figures of one policy: a group holds the K rollouts of one task.

    accuracy = solved rollouts / rollouts (= mean pass@1); pass@K (at least one of K right) and pass^K (all K
    right: consistency) per task, averaged; the share of sampled turns with each violation of the call format
    (`runs.metrics.violation_metrics`, `calls_in_reasoning` the renderer's); tool-use and
    per-tool rates, turns and lengths from `rollout_metrics`; accuracy split by whether the rollout
    used a tool; tool calls per solved rollout; by task, whether the policy tries its tools
    (`runs.metrics.tool_decision_metrics`); with tasks of several environments, the main figures of
    each (`env/<name>/...`). Infrastructure errors are counted and left out of every rate.
    """
    return {**_figures(groups, success_threshold), **violation_metrics(
        [t for g in groups for t in g.trajectories], calls_in_reasoning), **_per_env(groups, success_threshold)}


def _figures(groups: Sequence[TrajectoryGroup], success_threshold: float) -> dict[str, float]:
    trajs = [t for g in groups for t in g.trajectories]
    ok = [t for t in trajs if not t.infra_error]
    solved = [t.reward >= success_threshold for t in ok]
    report: dict[str, float] = {"tasks": float(len(groups)), "rollouts": float(len(trajs)),
                                "accuracy": fmean(solved) if ok else 0.0}
    counts = [(len(done), sum(t.reward >= success_threshold for t in done))
              for g in groups if (done := [t for t in g.trajectories if not t.infra_error])]
    report.update(pass_figures(counts, sorted({1, *(len(g.trajectories) for g in groups)})))
    with_tools = [s for t, s in zip(ok, solved) if t.used_tools]
    without = [s for t, s in zip(ok, solved) if not t.used_tools]
    report["accuracy_with_tools"] = fmean(with_tools) if with_tools else 0.0
    report["accuracy_without_tools"] = fmean(without) if without else 0.0
    # how long the solved ones took: tool calls per solved rollout (failed calls included); NaN when none
    report["tool_calls_per_solved"] = fmean([len(t.tool_calls) for t, s in zip(ok, solved) if s]) if any(solved) \
        else math.nan
    metrics = rollout_metrics(trajs)
    metrics.pop("rollouts", None)
    return {**report, **metrics, **tool_decision_metrics(groups, success_threshold)}


def _per_env(groups: Sequence[TrajectoryGroup], success_threshold: float) -> dict[str, float]:
    """The headline figures of `eval_report` for each environment of a mixture (none for one environment)."""
    envs = sorted({g.trajectories[0].env for g in groups if g.trajectories} - {""})
    out: dict[str, float] = {}
    for name in envs:
        mine = _figures([g for g in groups if g.trajectories and g.trajectories[0].env == name], success_threshold)
        kept = ("tasks", "accuracy_with_tools", "accuracy_without_tools")
        out.update({f"env/{name}/{k}": v for k, v in mine.items()
                    if k in ENV_FIGURES or k in kept or k.startswith(("pass@", "pass^"))})
    return out


@dataclass(frozen=True)
class PolicySpec:
    """What `--adapter` named: the base model, a LoRA adapter folder, or a folder of full weights."""

    label: str
    kind: str  # "base", "adapter" or "weights"
    path: Path | None = None


def _newest(path: Path, pattern: str, marker: str) -> Path | None:
    versions = sorted((int(p.name[1:]), p) for p in path.glob(pattern)
                      if p.name[1:].isdigit() and (p / marker).is_file())
    return versions[-1][1] if versions else None


def resolve_policy(spec: str) -> PolicySpec:
    """`base`; a peft adapter folder, or a run folder's `adapter/` (written at the end of `agent-rl sft`
    and `agent-rl train`), else its newest `adapters/v*`; a model folder of full weights (config.json),
    or a full fine-tune run's newest `weights/v*`."""
    if spec == BASE:
        return PolicySpec(spec, "base")
    path = Path(spec)
    for folder in (path, path / "adapter"):
        if (folder / "adapter_config.json").is_file():
            return PolicySpec(spec, "adapter", folder)
    if (newest := _newest(path, "adapters/v*", "adapter_config.json")) is not None:
        return PolicySpec(spec, "adapter", newest)
    if (path / "config.json").is_file():
        return PolicySpec(spec, "weights", path)
    if (newest := _newest(path, "weights/v*", "config.json")) is not None:
        return PolicySpec(spec, "weights", newest)
    raise ValueError(f"adapter {spec!r}: not a peft adapter folder (no adapter_config.json), a model folder "
                     f"(config.json), nor a run folder with adapter/, adapters/v* or weights/v*; use 'base' "
                     f"for the model without an adapter")


def env_verdict(traj: Trajectory, success_threshold: float = 1.0) -> dict[str, Any] | None:
    """The verdict on an environment's episode kept with its replies (`runs.replies`): solved when its reward
    reaches the threshold; None for an infrastructure error."""
    if traj.infra_error:
        return None
    return {"valid": traj.reward >= success_threshold, "error_type": None, "errors": []}


def compare(reports: dict[str, dict[str, float]]) -> dict[str, float]:
    """second - first, for every figure both reports have."""
    (_, a), (_, b) = list(reports.items())[:2]
    return {k: b[k] - a[k] for k in a if k in b}


async def _play(session: Session, tasks: list, limits: EpisodeLimits, urls: Sequence[str], adapter: Path | None,
                tmp: Path) -> list[TrajectoryGroup]:
    """The held-out tasks on servers `urls`, with `adapter` loaded under a name unique to this process
    (a shared server may hold others), or with the served weights as they are."""
    cfg = session.cfg
    async with serving_backend().sampler(list(urls), request_timeout_s=cfg.sampler.request_timeout_s) as local, \
            with_workers(session, urls, local) as served:  # rollout.workers: the episodes play on Ray workers
        if adapter is not None:
            prefix = f"eval-{os.getpid()}-{secrets.token_hex(3)}"
            await AdapterSync(tmp, served.sampler, prefix=prefix).load_initial(adapter)
        return await play_groups(tasks, episodes(session, served.players, limits, cfg.eval.samples),
                                 cfg.rollout.max_concurrent)


async def play_policies(session: Session, policies: Sequence[PolicySpec], tasks: list, limits: EpisodeLimits,
                        serve: Callable[[Path], Any]) -> dict[str, list[TrajectoryGroup]]:
    """Each policy plays `tasks` (`cfg.eval.samples` times each, `session.env.make_env`) with the same
    limits and sampling seeds; the base model and its adapters share one server, full weights get their own."""
    groups: dict[str, list[TrajectoryGroup]] = {}
    with tempfile.TemporaryDirectory(prefix="agent-rl-eval-") as tmp:
        shared = [p for p in policies if p.kind != "weights"]
        if shared:
            with serve(session.model_dir) as fleet:
                for i, p in enumerate(shared):
                    groups[p.label] = await _play(session, tasks, limits, fleet.urls, p.path, Path(tmp) / str(i))
        for p in policies:
            if p.kind == "weights" and p.path is not None:  # resolve_policy gives weights a folder
                with serve(p.path) as fleet:
                    groups[p.label] = await _play(session, tasks, limits, fleet.urls, None, Path(tmp))
    return groups


async def evaluate(session: Session, specs: Sequence[str], serve: Callable[[Path], Any],
                   groups_out: dict | None = None) -> dict[str, Any]:
    """Evaluate each policy spec (`resolve_policy`) on `cfg.eval` held-out tasks.

    `serve(model_dir)` is a context manager giving the servers of a model folder (a `rollout.serving.base.Fleet`:
    the serving backend's `serve`): the base model and its adapters share one; full weights get their own.
    Returns {"eval": settings, "results": {spec: figures}, "delta": second - first (two)}.
    `groups_out`, when given, receives each policy's rollout groups (for printing transcripts).
    """
    cfg = session.cfg
    settings, rollout = cfg.eval, cfg.rollout
    policies = [resolve_policy(s) for s in specs]  # every bad path fails before any sampling
    if any(p.kind == "weights" for p in policies) and cfg.sampler.server_urls:
        raise ValueError("sampler.server_urls: full weights are evaluated on a server started on them; "
                         "drop the attached servers (got " + ", ".join(cfg.sampler.server_urls) + ")")
    tasks = session.env.load_tasks(settings.tasks, seed=settings.seed, split=settings.split)
    limits = EpisodeLimits.from_config(rollout, settings.temperature, seed=settings.seed)
    with ray_cluster(cfg.ray, rollout.workers):  # one cluster for every policy's workers
        groups = await play_policies(session, policies, tasks, limits, serve)
    if groups_out is not None:
        groups_out.update({p.label: groups[p.label] for p in policies})
    results = {p.label: eval_report(groups[p.label], settings.success_threshold, session.renderer.calls_in_reasoning)
               for p in policies}
    out: dict[str, Any] = {"eval": {"env": session.env.name, "model": cfg.model.name, **settings.model_dump()},
                           "results": results}
    if len(results) >= 2:
        out["delta"] = compare(results)
    return out
