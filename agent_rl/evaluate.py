"""Held-out evaluation: accuracy, pass@k and tool use of one or more policies on the same tasks.

Owns: `eval_report` (a pure function from rollout groups to figures), `pass_at_k` (the unbiased
estimator of Chen et al. 2021), `resolve_adapter` (what a user may point `--adapter` at), and
`evaluate` (serve each adapter, play the held-out tasks, report; two adapters side by side) and
`format_report` (the figures side by side as a table).
Does not own: playing episodes (`rollout.runner`), behavioural rates (`runs.metrics`), servers.

Fair comparisons: every policy plays the same tasks with the same per-request sampling seeds, so
two adapters differ only by their weights (common random numbers), not by the luck of the draw.
"""

from __future__ import annotations

import math
import os
import secrets
import tempfile
from pathlib import Path
from statistics import fmean
from typing import Any, Sequence

from agent_rl.core.types import TrajectoryGroup
from agent_rl.rollout.runner import EpisodeLimits, rollout_groups
from agent_rl.rollout.sampler import VLLMSampler
from agent_rl.rollout.weight_sync import AdapterSync
from agent_rl.runs.metrics import rollout_metrics
from agent_rl.session import Session

BASE = "base"


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k draws without replacement from n samples, c of them correct, is correct)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_report(groups: Sequence[TrajectoryGroup], success_threshold: float = 1.0) -> dict[str, float]:
    """Figures of one policy: a group holds the K rollouts of one task.

    accuracy = solved rollouts / rollouts (= mean pass@1); pass@K per task, averaged; tool-use and
    per-tool rates, turns and lengths from `rollout_metrics`; accuracy split by whether the rollout
    used a tool. Infrastructure errors are counted and left out of every rate.
    """
    trajs = [t for g in groups for t in g.trajectories]
    ok = [t for t in trajs if not t.infra_error]
    solved = [t.reward >= success_threshold for t in ok]
    report: dict[str, float] = {"tasks": float(len(groups)), "rollouts": float(len(trajs)),
                                "accuracy": fmean(solved) if ok else 0.0}
    ks = sorted({1, *(len(g.trajectories) for g in groups)})
    for k in ks:
        per_task = []
        for g in groups:
            done = [t for t in g.trajectories if not t.infra_error]
            if len(done) >= k:
                per_task.append(pass_at_k(len(done), sum(t.reward >= success_threshold for t in done), k))
        report[f"pass@{k}"] = fmean(per_task) if per_task else 0.0
    with_tools = [s for t, s in zip(ok, solved) if t.used_tools]
    without = [s for t, s in zip(ok, solved) if not t.used_tools]
    report["accuracy_with_tools"] = fmean(with_tools) if with_tools else 0.0
    report["accuracy_without_tools"] = fmean(without) if without else 0.0
    metrics = rollout_metrics(trajs)
    metrics.pop("rollouts", None)
    return {**report, **metrics}


def resolve_adapter(spec: str) -> Path | None:
    """`base` (no adapter), a peft adapter folder, or a run folder: its `adapter/` (written at the end
    of `agent-rl sft` and `agent-rl train`), else its newest `adapters/v*`."""
    if spec == BASE:
        return None
    path = Path(spec)
    if (path / "adapter_config.json").is_file():
        return path
    if (path / "adapter" / "adapter_config.json").is_file():
        return path / "adapter"
    versions = sorted((int(p.name[1:]), p) for p in path.glob("adapters/v*")
                      if p.name[1:].isdigit() and (p / "adapter_config.json").is_file())
    if versions:
        return versions[-1][1]
    raise ValueError(f"adapter {spec!r}: not a peft adapter folder (no adapter_config.json) nor a run folder "
                     f"with adapter/ or adapters/v*; use 'base' for the model without an adapter")


def compare(reports: dict[str, dict[str, float]]) -> dict[str, float]:
    """second - first, for every figure both reports have."""
    (_, a), (_, b) = list(reports.items())[:2]
    return {k: b[k] - a[k] for k in a if k in b}


async def evaluate(session: Session, adapters: Sequence[str], urls: Sequence[str],
                   groups_out: dict | None = None) -> dict[str, Any]:
    """Evaluate each adapter spec on `cfg.eval` held-out tasks against running servers `urls`.

    Returns {"eval": settings, "results": {adapter: figures}, "delta": second - first (two adapters)}.
    `groups_out`, when given, receives each adapter's rollout groups (for printing transcripts).
    """
    cfg, spec, renderer = session.cfg, session.env, session.renderer
    settings, rollout = cfg.eval, cfg.rollout
    paths = {a: resolve_adapter(a) for a in adapters}  # every bad path fails before any sampling
    tasks = spec.load_tasks(settings.tasks, seed=settings.seed, split=settings.split)
    limits = EpisodeLimits.from_config(rollout, settings.temperature, seed=settings.seed)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="agent-rl-eval-") as tmp:
        for i, (label, path) in enumerate(paths.items()):
            async with VLLMSampler(list(urls), request_timeout_s=cfg.sampler.request_timeout_s) as sampler:
                if path is not None:  # a name unique to this process: a shared server may hold others
                    sync = AdapterSync(Path(tmp) / str(i), sampler, prefix=f"eval-{os.getpid()}-{secrets.token_hex(3)}")
                    await sync.load_initial(path)
                groups = await rollout_groups(tasks, spec.make_env, sampler, renderer, limits, settings.samples,
                                              rollout.max_concurrent)
            if groups_out is not None:
                groups_out[label] = groups
            results[label] = eval_report(groups, settings.success_threshold)
    out: dict[str, Any] = {"eval": {"env": rollout.env, "model": cfg.model.name, **settings.model_dump()},
                           "results": results}
    if len(results) >= 2:
        out["delta"] = compare(results)
    return out


def format_report(report: dict[str, Any]) -> str:
    """The figures of each adapter side by side (and their difference for two), one row per figure."""
    results = report["results"]
    labels = list(results)
    keys = [k for k in ("accuracy", *sorted(k for k in results[labels[0]] if k.startswith("pass@")),
                        "tool_use_rate", "accuracy_with_tools", "accuracy_without_tools", "tool_calls_per_traj",
                        "tool_failure_rate", "turns_mean", "sampled_tokens_mean", "truncation_rate",
                        "infra_error_rate") if k in results[labels[0]]]
    keys += sorted(k for k in results[labels[0]] if k.startswith("tool/") and k.endswith("rate"))
    head = [""] + [_short(lb) for lb in labels] + (["delta"] if "delta" in report else [])
    rows = [head] + [[k] + [f"{results[lb].get(k, float('nan')):.3f}" for lb in labels]
                     + ([f"{report['delta'].get(k, float('nan')):+.3f}"] if "delta" in report else []) for k in keys]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def _short(label: str, width: int = 28) -> str:
    return label if len(label) <= width else "..." + label[-(width - 3):]
