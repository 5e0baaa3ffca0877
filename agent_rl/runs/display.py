"""Trajectories for human eyes: sampled tokens set apart from masked (prompt/template/tool) ones.

Owns: `mask_runs` (a token sequence cut into runs of equal loss mask and policy version, shared by the
terminal view and the trace files of `runs.traces`) and `format_trajectory`. Does not own: any decision about the
trajectory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby

from agent_rl.core.renderers.base import Renderer
from agent_rl.core.types import Trajectory

GREEN, DIM, RESET = "\033[32m", "\033[2m", "\033[0m"


@dataclass(frozen=True)
class MaskRun:
    """Consecutive tokens with the same loss mask and policy version: sampled by the policy (1) or context (0)."""

    sampled: bool
    start: int  # position of the first token in the sequence
    token_ids: tuple[int, ...]
    mean_logprob: float  # of the sampler's log-probs (0.0 for context: they are 0.0 there)
    version: int = -1  # the policy version that sampled the run; -1: context, or not known


def mask_runs(token_ids: Sequence[int], loss_mask: Sequence[int], logprobs: Sequence[float],
              versions: Sequence[int] | None = None) -> list[MaskRun]:
    """The runs of equal mask, a sampled one cut where the version changes (weights pushed in between)."""
    runs, pos = [], 0
    tagged = zip(token_ids, loss_mask, logprobs, versions if versions is not None else [-1] * len(token_ids))
    for (sampled, version), run in groupby(tagged, key=lambda x: (x[1], x[3] if x[1] else -1)):
        block = list(run)
        runs.append(MaskRun(bool(sampled), pos, tuple(b[0] for b in block), sum(b[2] for b in block) / len(block),
                            version))
        pos += len(block)
    return runs


def format_trajectory(traj: Trajectory, renderer: Renderer, title: str = "", color: bool = False) -> str:
    """Each run of equal mask values as one block: `[policy N tok]` for sampled ones, `[context N tok]` else."""
    tools = ", ".join(f"{c.name}:{'ok' if c.ok else 'error'}" for c in traj.tool_calls) or "none"
    head = (f"=== {title or traj.task_id}  reward={traj.reward:g}  stop={traj.stop_reason.value}  "
            f"turns={len(traj.turns)}  tokens={len(traj.token_ids)} (sampled {traj.num_sampled})  "
            f"tools=[{tools}]  policy=v{traj.policy_version} ===")
    lines = [head]
    if traj.error:
        lines.append(f"!!! infrastructure error: {traj.error}")
    for run in mask_runs(traj.token_ids, traj.loss_mask, traj.logprobs, traj.versions):
        text = renderer.render_text(run.token_ids)
        if run.sampled:
            label = (f"[policy v{run.version} {len(run.token_ids)} tok @ {run.start}, "
                     f"mean logprob {run.mean_logprob:.3f}]")
            body = f"{GREEN}{text}{RESET}" if color else text
        else:
            label = f"[context {len(run.token_ids)} tok @ {run.start}, masked]"
            body = f"{DIM}{text}{RESET}" if color else text
        lines += [label, body]
    return "\n".join(lines)
