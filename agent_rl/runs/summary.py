"""The short tables a person reads at the end of `agent-rl eval`, `agent-rl train` and `make train`.

Owns: `policy_table` (a row per policy: accuracy, pass@K and pass^K, tool use, attempts, turns, violations of
the call format; with a baseline, each other policy's gain over it, and with two or more such policies, the
spread of each figure over them: the seeds of a recipe), `run_table` (a training run's first and last step) and
`where` (the lines that say where the files are).
Does not own: the figures (`agent_rl.evaluation`, `runs.metrics`), the files themselves (the JSON report, the
metrics log and the PNGs stay where their owners write them: a table is for reading, the files for machines).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agent_rl.runs.runlog import RunLogError

# (heading, figure) of a policy's row; pass@K and pass^K take the largest K the figures have
POLICY_COLUMNS = (("accuracy", "accuracy"), ("pass@K", "pass@"), ("pass^K", "pass^"), ("tool use", "tool_use_rate"),
                  ("attempts", "tool/attempt_share"), ("turns", "turns_mean"), ("violations", "violation/any"))
RUN_COLUMNS = (("reward", "reward_mean"), ("correct", "reward/correct"), ("tool use", "tool_use_rate"),
               ("attempts", "tool/attempt_share"), ("turns", "turns_mean"), ("cut", "truncation_rate"))


def _largest_k(figures: dict[str, Any], prefix: str) -> str | None:
    ks = [int(k[len(prefix):]) for k in figures if k.startswith(prefix) and k[len(prefix):].isdigit()]
    return f"{prefix}{max(ks)}" if ks else None


def _keys(figures: dict[str, Any]) -> list[tuple[str, str | None]]:
    """(heading, key) of each policy column, pass@K and pass^K with the K the figures have."""
    out = []
    for head, key in POLICY_COLUMNS:
        if key in ("pass@", "pass^"):
            found = _largest_k(figures, key)
            out.append((head.replace("K", found[len(key):]) if found else head, found))
        else:
            out.append((head, key))
    return out


def _cell(value: Any, signed: bool = False) -> str:
    if not isinstance(value, int | float) or value != value:  # missing, or NaN
        return "-"
    return f"{value:+.3f}" if signed else f"{value:.3f}"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     .rstrip() for r in rows)


def policy_table(results: dict[str, dict[str, Any]], baseline: str | None = None,
                 names: dict[str, str] | None = None, spread: str = "spread") -> str:
    """A row per policy of `results` ({label: eval figures}); with `baseline`, a gain row for each other policy,
    and a `spread` row (max - min over those policies: "seed spread" where they are seeds) when there are two or
    more. `names` shortens labels."""
    labels = list(results)
    keys = _keys(results[labels[0]])
    name = {lb: (names or {}).get(lb, lb) for lb in labels}
    rows = [["policy", *(head for head, _ in keys)]]
    rows += [[name[lb], *(_cell(results[lb].get(k)) if k else "-" for _, k in keys)] for lb in labels]
    others = [lb for lb in labels if lb != baseline]
    if baseline in results and others:
        base = results[baseline]
        rows += [[f"gain {name[lb]}", *(_cell(_minus(results[lb], base, k), signed=True) for _, k in keys)]
                 for lb in others]
        if len(others) >= 2:
            rows.append([spread, *(_cell(_spread([results[lb].get(k) for lb in others if k])) for _, k in keys)])
    return _table(rows)


def _minus(a: dict[str, Any], b: dict[str, Any], key: str | None) -> float | None:
    if key is None or not isinstance(a.get(key), int | float) or not isinstance(b.get(key), int | float):
        return None
    return a[key] - b[key]


def _spread(values: Sequence[Any]) -> float | None:
    numbers = [v for v in values if isinstance(v, int | float) and v == v]
    return max(numbers) - min(numbers) if numbers else None


def run_table(records: Sequence[dict[str, Any]]) -> str:
    """A training run's first and last step (from metrics.jsonl): reward, the share answered right where the
    environment scores it, tool use, attempts, turns and the share of episodes cut; a column none has is left out."""
    if not records:
        raise RunLogError("no step has been logged")
    shown = [records[0], records[-1]] if len(records) > 1 else list(records)
    columns = [(head, key) for head, key in RUN_COLUMNS if any(key in r for r in shown)]
    rows = [["step", *(head for head, _ in columns)]]
    rows += [[str(r.get("step", "?")), *(_cell(r.get(key)) for _, key in columns)] for r in shown]
    return _table(rows)


def where(**paths: Any) -> str:
    """`name: path` lines for the files a command wrote (None: not written, left out)."""
    return "\n".join(f"{name.replace('_', ' ')}: {path}" for name, path in paths.items() if path)
