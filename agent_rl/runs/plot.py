"""Training curves as PNG files, read back from a run directory's metrics.jsonl.

Owns: `plot_run(run_dir)`, which writes `<run_dir>/plots/curves.png` (one panel per concern) and
`<run_dir>/plots/accuracy_tool_use.png` (did it learn the task, and did it keep using its tools?),
and `plot_runs(run_dirs, path)`: those two figures for several runs side by side (seeds).
Does not own: the metrics file format (`runs.runlog`), or computing any metric.

Only keys present in the file are drawn: a panel with none of its keys is left out, so the same
code plots a run with or without a KL term, timings or an accuracy reward. Uses matplotlib's
object API with the Agg canvas (no pyplot, no display, no global backend switch).
`python -m agent_rl.runs.plot RUN_DIR` does the same from a shell.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_rl.runs.runlog import RunLogError, read_metrics

PLOTS_DIR = "plots"


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]  # each present key is one line
    band: tuple[str, str] | None = None  # (mean key, std key): shade mean ± std
    alarm: str | None = None  # 0/1 key: red marks at the steps where it fired
    prefix: str | None = None  # every key starting with this, stacked (time split)...
    total: str | None = None  # ...except this one, drawn as a line over the stack
    unit: bool = False  # rates: y from 0 to 1, so a drop from 0.6 to 0.3 looks like one


PANELS = (
    Panel("reward (mean ± the spread of a group's returns)", ("reward_mean",), band=("reward_mean", "reward_std")),
    Panel("tool use", ("tool_use_rate", "tool_failure_rate"), alarm="alarm/tool_collapse", unit=True),
    Panel("the tool decision (groups)", ("tool/no_attempt_groups", "tool/all_fail_groups", "branch/share"), unit=True),
    Panel("entropy (nats / sampled token)", ("entropy",), alarm="alarm/entropy_collapse"),
    Panel("KL", ("kl", "approx_kl_old")),
    Panel("clip fraction", ("clip_frac", "tis_capped_frac")),
    Panel("zero-variance groups (share)", ("zero_variance_group_share",), unit=True),
    Panel("lengths (tokens per trajectory)", ("tokens_mean", "sampled_tokens_mean")),
    # with rollouts streaming on (max_staleness > 0) the parts overlap in time: the stack can exceed the total
    Panel("time split (s per step)", (), prefix="time/", total="time/step_s"),
)


def _series(records: list[dict[str, Any]], key: str) -> list[float]:
    return [math.nan if r.get(key) is None else float(r[key]) for r in records]


def _present(records: list[dict[str, Any]], key: str) -> bool:
    return any(r.get(key) is not None for r in records)


def _panel_keys(panel: Panel, records: list[dict[str, Any]]) -> list[str]:
    if panel.prefix:
        keys = sorted({k for r in records for k in r if k.startswith(panel.prefix) and k != panel.total})
        return [k for k in keys if _present(records, k)]
    return [k for k in panel.keys if _present(records, k)]


def _style(ax: Any, title: str, unit: bool) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.tick_params(labelsize=8)
    if unit:
        ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def _draw(ax: Any, panel: Panel, records: list[dict[str, Any]], steps: list[int], keys: list[str]) -> None:
    if panel.prefix:
        ax.stackplot(steps, *[[0.0 if math.isnan(v) else v for v in _series(records, k)] for k in keys],
                     labels=[k.removeprefix(panel.prefix) for k in keys], alpha=0.8)
        if panel.total and _present(records, panel.total):
            ax.plot(steps, _series(records, panel.total), "k-", lw=1.2, label=panel.total.removeprefix(panel.prefix))
    else:
        for key in keys:
            ax.plot(steps, _series(records, key), marker="." if len(steps) <= 50 else None, label=key)
    if panel.band and _present(records, panel.band[1]):
        mean, std = _series(records, panel.band[0]), _series(records, panel.band[1])
        ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                        alpha=0.2, label="± std")
    if panel.alarm:
        fired = [s for s, v in zip(steps, _series(records, panel.alarm)) if v == 1.0]
        if fired:
            ax.plot(fired, [0.0] * len(fired), "rv", label=panel.alarm, clip_on=False)
    _style(ax, panel.title, panel.unit)


def _accuracy_key(records: list[dict[str, Any]]) -> str:
    return "reward/correct" if _present(records, "reward/correct") else "reward_mean"


def _records(run_dir: str | Path) -> list[dict[str, Any]]:
    by_step = {r["step"]: r for r in read_metrics(run_dir)}  # a resumed run without truncation: last wins
    if not by_step:
        raise RunLogError(f"{Path(run_dir) / 'metrics.jsonl'} has no steps yet")
    return [by_step[s] for s in sorted(by_step)]


def plot_runs(run_dirs: list[str | Path], path: str | Path) -> Path:
    """Accuracy and tool-use rate per step of several runs (seeds of one recipe), a line per run:
    the spread between seeds at a glance. Writes and returns `path`."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise RunLogError("plotting needs matplotlib: pip install matplotlib") from None
    runs = [(Path(d).name, _records(d)) for d in run_dirs]
    fig = Figure(figsize=(11, 4), layout="constrained")
    accuracy, tools = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for name, records in runs:
        steps = [r["step"] for r in records]
        accuracy.plot(steps, _series(records, _accuracy_key(records)), marker=".", label=name)
        tools.plot(steps, _series(records, "tool_use_rate"), marker=".", label=name)
    _style(accuracy, "accuracy", unit=True)
    _style(tools, "tool-use rate", unit=True)
    fig.savefig(path, dpi=110)
    return Path(path)


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write the PNGs for `run_dir` and return their paths (none when no known key is present)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise RunLogError("plotting needs matplotlib: pip install matplotlib") from None
    records = _records(run_dir)
    steps = [r["step"] for r in records]
    out = Path(run_dir) / PLOTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    written = []

    panels = [(p, keys) for p in PANELS if (keys := _panel_keys(p, records))]
    if panels:
        cols = 2 if len(panels) > 1 else 1
        rows = math.ceil(len(panels) / cols)
        fig = Figure(figsize=(6 * cols, 3.2 * rows), layout="constrained")
        fig.suptitle(f"{Path(run_dir).resolve().name}: {len(steps)} steps")
        for i, (panel, keys) in enumerate(panels):
            _draw(fig.add_subplot(rows, cols, i + 1), panel, records, steps, keys)
        path = out / "curves.png"
        fig.savefig(path, dpi=110)
        written.append(path)

    keys = [k for k in (_accuracy_key(records), "tool_use_rate") if _present(records, k)]
    if keys:
        fig = Figure(figsize=(7, 4), layout="constrained")
        ax = fig.add_subplot()
        for key in keys:
            ax.plot(steps, _series(records, key), marker="." if len(steps) <= 50 else None, label=key)
        values = [v for k in keys for v in _series(records, k) if not math.isnan(v)]
        _style(ax, "accuracy and tool use", unit=all(0.0 <= v <= 1.0 for v in values))
        path = out / "accuracy_tool_use.png"
        fig.savefig(path, dpi=110)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m agent_rl.runs.plot RUN_DIR", file=sys.stderr)
        return 2
    try:
        for path in plot_run(args[0]):
            print(path)
    except RunLogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
