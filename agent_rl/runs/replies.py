"""The replies an evaluation keeps beside its scores, so that anyone can check a score against what was written.

Owns: `replies_path` (where they go: `X.replies.jsonl` beside the report `X.json`), `reply_record` (one episode:
its policy, task, every message with the calls the renderer parsed, the verdict and the checker's error type, the
violations of the call format of each sampled turn, the rendered text of its tokens), `write_replies`, and
`read_replies` (the file as the steps of `agent-rl view`'s page: one per policy).
Does not own: what a verdict is (the benchmark's checker, `agent_rl.evaluation`), the trace record's fields
(`runs.traces.trace_record`), the page (`runs.view`).

A verdict is `{"valid", "error_type", "errors"}`: bfcl-eval's own for a BFCL episode; for an environment's,
whether its reward reached `eval.success_threshold`, with no error type. An episode that ended in an
infrastructure error has none (its `error` says why). The token ids and log-probs are left out (the text of each
run of the tokens stays): an evaluation's replies are for reading.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent_rl.core.files import write_lines
from agent_rl.core.renderers.base import Renderer
from agent_rl.core.types import Trajectory
from agent_rl.runs.metrics import VIOLATIONS, reply_violations, sampled_replies
from agent_rl.runs.traces import trace_record

SUFFIX = ".replies.jsonl"


def replies_path(report: str | Path) -> Path:
    """`X.replies.jsonl` beside the report `X.json` (any other name: the suffix added)."""
    report = Path(report)
    return report.with_name((report.name[:-len(".json")] if report.name.endswith(".json") else report.name) + SUFFIX)


def reply_record(traj: Trajectory, renderer: Renderer, verdict: dict[str, Any] | None, policy: str,
                 **where: Any) -> dict[str, Any]:
    """One episode of an evaluation as a JSON-ready dict (module doc); `where` (group, index, ...) goes first."""
    record = trace_record(traj, renderer, **where)
    record["segments"] = [{"runs": s["runs"]} for s in record["segments"]]
    found = [reply_violations(m, traj.tools, renderer.calls_in_reasoning) for m in sampled_replies(traj)]
    return {"policy": policy, **record, "verdict": verdict,
            "violations": [[name for name in VIOLATIONS if f[name]] for f in found]}


def write_replies(path: str | Path, episodes: dict[str, Sequence[tuple[Trajectory, dict[str, Any] | None]]],
                  renderer: Renderer) -> Path:
    """Each policy's episodes with their verdicts, one line each, grouped by task in the order played."""
    lines = []
    for policy, rows in episodes.items():
        sizes = Counter(traj.task_id for traj, _ in rows)
        tasks = {task: i for i, task in enumerate(sizes)}
        seen: Counter[str] = Counter()
        for traj, verdict in rows:
            record = reply_record(traj, renderer, verdict, policy, group=tasks[traj.task_id], groups=len(tasks),
                                  index=seen[traj.task_id], group_size=sizes[traj.task_id])
            seen[traj.task_id] += 1
            lines.append(json.dumps(record, ensure_ascii=False, default=str))
    return write_lines(path, lines)


def read_replies(path: str | Path) -> list[dict[str, Any]]:
    """The file as the page's steps: one per policy, in file order, labelled with it, its headline figures (the
    share of valid verdicts among the episodes that have one, infrastructure errors) and its records."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} is not a file: give an evaluation's replies ({SUFFIX}) or a run directory")
    by_policy: dict[str, list[dict[str, Any]]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a kill
        if isinstance(record, dict) and "policy" in record:
            by_policy.setdefault(str(record["policy"]), []).append(record)
    if not by_policy:
        raise ValueError(f"no replies in {path}")
    steps = []
    for i, (policy, records) in enumerate(by_policy.items()):
        judged = [r["verdict"] for r in records if r.get("verdict")]
        metrics: dict[str, float] = {"episodes": len(records), "errors": sum(bool(r.get("error")) for r in records)}
        if judged:
            metrics["valid_share"] = sum(bool(v.get("valid")) for v in judged) / len(judged)
        steps.append({"step": i + 1, "label": policy, "metrics": metrics, "trajectories": records})
    return steps
