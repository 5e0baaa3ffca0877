"""Rollout traces: a sample of each step's trajectories, kept in the run directory for `agent-rl view`.

Owns: what a trace record holds (`trace_record`), which groups a step keeps (`pick_groups`), writing
`<run_dir>/traces/step-000001.jsonl` atomically (`write_step`), dropping the traces of steps after the
one a run resumes from (`truncate_after`) and reading them back (`read_traces`).
Does not own: the HTML page (`runs.view`), rendering ids to text (the renderer), advantages
(`learn.advantages`: the step hands in its result), metrics (`runs.runlog`).

A step keeps whole groups (GRPO compares rewards within a group, so a lone trajectory's advantage
means little): half of them (at least one) groups with a failure (an infrastructure error or a
truncated episode), when there are such, the rest spread evenly over the step's other groups; the choice
depends only on the groups, so a resumed run keeps the same ones. One line per trajectory:

    step, group (index in the step), groups (in the step), task_id, index (in the group), group_size,
    reward, reward_parts, advantage (null: not trained on) and dropped (why not), stop_reason,
    truncated, error, policy_version, num_tokens, num_sampled,
    messages (role, content, name, tool_calls parsed), turns (each with its own reward and parts, the
    state it started from, with credit per turn its advantage, and the policy versions that sampled it,
    oldest first: two where weights were pushed in the middle of the turn), tool_calls (what happened to each),
    segments: [{token_ids, loss_mask, logprobs, versions, runs}], runs being the text of each stretch of equal
    mask and policy version (sampled or context), rendered with special tokens, so the page needs no tokenizer.

A trajectory with earlier closed segments (`Trajectory.segments`, where a chat template broke the
token prefix) lists them first; the trajectory's own tokens are the last segment.
Steps are 1-based, as in metrics.jsonl. A line torn by a kill is skipped when reading.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent_rl.core.files import write_lines
from agent_rl.core.renderers.base import Renderer
from agent_rl.core.types import Trajectory, TrajectoryGroup, Turn
from agent_rl.runs.display import mask_runs

TRACES_DIR = "traces"
_STEP_FILE = re.compile(r"^step-(\d{6,})\.jsonl$")


class TraceError(ValueError):
    """No traces where they were asked for; `str(e)` is one line."""


def traces_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / TRACES_DIR


def step_file(run_dir: str | Path, step: int) -> Path:
    return traces_dir(run_dir) / f"step-{step:06d}.jsonl"


def _finite(x: float | None, digits: int | None = None) -> float | None:
    """JSON has no NaN or infinity (a browser's JSON.parse refuses them): such values become null."""
    if x is None or not math.isfinite(x):
        return None
    return float(x) if digits is None else round(float(x), digits)


def failed(traj: Trajectory) -> bool:
    return traj.infra_error or traj.truncated


def _spread(items: Sequence[int], k: int) -> list[int]:
    """`k` of `items` evenly spaced (the middle of each of k equal slices); all of them when k >= len."""
    if k >= len(items):
        return list(items)
    return [items[int((i + 0.5) * len(items) / k)] for i in range(k)]


def pick_groups(groups: Sequence[TrajectoryGroup], n: int) -> list[int]:
    """Indices of the `n` groups a step keeps, in step order; see the module docstring."""
    if n <= 0:
        return []
    failing = [i for i, g in enumerate(groups) if any(failed(t) for t in g.trajectories)]
    others = [i for i in range(len(groups)) if i not in failing]
    picked = _spread(failing, max(1, n // 2))
    picked += _spread(others, n - len(picked))
    picked += _spread([i for i in failing if i not in picked], n - len(picked))  # too few others
    return sorted(picked)


def _segment(seq: Any, renderer: Renderer) -> dict[str, Any]:
    """One token sequence: the ids, mask and log-probs as trained, and the text of each mask run."""
    runs = [{"sampled": r.sampled, "start": r.start, "n": len(r.token_ids), "text": renderer.render_text(r.token_ids),
             "mean_logprob": _finite(r.mean_logprob, 4) if r.sampled else None,
             "version": r.version if r.sampled else None}
            for r in mask_runs(seq.token_ids, seq.loss_mask, seq.logprobs, seq.versions)]
    return {"token_ids": list(seq.token_ids), "loss_mask": list(seq.loss_mask),
            "logprobs": [_finite(x, 4) for x in seq.logprobs], "versions": list(seq.versions), "runs": runs}


def _turn_versions(traj: Trajectory, turn: Turn) -> list[int]:
    """The policy versions that sampled a turn's tokens, oldest first (one, unless a push came mid-turn)."""
    versions = traj.all_segments[turn.segment].versions[turn.start:turn.end]
    return sorted({v for v in versions if v >= 0}) or [turn.policy_version]


def _messages(traj: Trajectory) -> list[dict[str, Any]]:
    return [{"role": m.role, "content": m.content, "name": m.name,
             "tool_calls": [{"name": c.name, "arguments": c.arguments, "id": c.id, "error": c.error}
                            for c in m.tool_calls]}
            for m in traj.messages]


def trace_record(traj: Trajectory, renderer: Renderer, advantage: float | None = None,
                 dropped: str | None = None, turn_advantages: tuple[float, ...] | None = None,
                 **where: Any) -> dict[str, Any]:
    """One trajectory as a JSON-ready dict; `where` (step, group, index, ...) goes first."""
    segments = traj.all_segments
    per_turn = turn_advantages if turn_advantages is not None else (None,) * len(traj.turns)
    return {
        **where, "task_id": traj.task_id, "reward": _finite(traj.reward),
        "reward_parts": {k: _finite(v) for k, v in traj.reward_parts.items()},
        "advantage": _finite(advantage), "dropped": dropped, "stop_reason": traj.stop_reason.value,
        "truncated": traj.truncated, "error": traj.error, "policy_version": traj.policy_version,
        "num_tokens": traj.num_tokens, "num_sampled": traj.num_sampled,
        "messages": _messages(traj),
        "turns": [{"start": t.start, "end": t.end, "finish_reason": t.finish_reason,
                   "policy_version": t.policy_version, "versions": _turn_versions(traj, t),
                   "reward": _finite(t.reward), "reward_parts": {k: _finite(v) for k, v in t.reward_parts.items()},
                   "state": t.state, "advantage": _finite(a)} for t, a in zip(traj.turns, per_turn)],
        "tool_calls": [{"name": c.name, "ok": c.ok, "error": c.error, "latency_s": _finite(c.latency_s, 4),
                        "turn": c.turn} for c in traj.tool_calls],
        "segments": [_segment(s, renderer) for s in segments],
    }


def _why_dropped(traj: Trajectory, group_trained: bool) -> str:
    if traj.infra_error:
        return "infrastructure error: kept out of the group's statistics"
    if group_trained:
        return "truncated: masked out of the loss"
    return "group without reward variance: no advantage"


def write_step(run_dir: str | Path, step: int, groups: Sequence[TrajectoryGroup], adv: Any,
               renderer: Renderer, keep_groups: int) -> Path | None:
    """Write step `step`'s picked groups; `adv` has `.trajectories` and `.advantages` (the batch).

    Returns the file, or None when `keep_groups` is 0 (traces off).
    """
    picked = pick_groups(groups, keep_groups)
    if not picked:
        return None
    advantage = {id(t): a for t, a in zip(adv.trajectories, adv.advantages)}
    per_turn = dict(zip(map(id, adv.trajectories), getattr(adv, "turn_advantages", None) or ()))
    lines = []
    for g in picked:
        trajs = groups[g].trajectories
        trained = any(id(t) in advantage for t in trajs)
        for i, t in enumerate(trajs):
            a = advantage.get(id(t))
            record = trace_record(t, renderer, a, None if a is not None else _why_dropped(t, trained),
                                  per_turn.get(id(t)), step=step, group=g, groups=len(groups), index=i,
                                  group_size=len(trajs))
            lines.append(json.dumps(record, ensure_ascii=False, default=str))
    return write_lines(step_file(run_dir, step), lines)


def _step_files(run_dir: str | Path) -> list[tuple[int, Path]]:
    root = traces_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_FILE.match(p.name)))


def truncate_after(run_dir: str | Path, step: int) -> int:
    """Resume at `step` (0: a fresh run): drop the traces of every later step. Returns the steps kept."""
    kept = 0
    for s, path in _step_files(run_dir):
        if s > step:
            path.unlink(missing_ok=True)
        else:
            kept += 1
    return kept


def read_traces(run_dir: str | Path, steps: set[int] | None = None) -> dict[int, list[dict[str, Any]]]:
    """{step: its records in file order} for the traced steps (those in `steps` only, when given)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise TraceError(f"{run_dir} is not a directory: give a run directory (run.run_dir of a training config) "
                         "or an evaluation's replies (.replies.jsonl)")
    files = _step_files(run_dir)
    if not files:
        raise TraceError(f"no traces in {run_dir}: {TRACES_DIR}/ is missing or empty (run.trace_groups was 0, "
                         "or no training step has finished yet)")
    out = {}
    for s, path in files:
        if steps is not None and s not in steps:
            continue
        records = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                records.append(record)
        out[s] = records
    if not out:
        raise TraceError(f"none of the asked steps is traced in {run_dir}; traced steps: "
                         f"{spans([s for s, _ in files])}")
    return out


def spans(steps: Sequence[int]) -> str:
    """Sorted steps as ranges: [1, 2, 3, 7] -> "1-3, 7" (a long run's steps fit on one line)."""
    out: list[list[int]] = []
    for s in steps:
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)
