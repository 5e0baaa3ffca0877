"""Trajectories for human eyes: sampled tokens set apart from masked (prompt/template/tool) ones.

Owns: `format_trajectory`. Does not own: any decision about the trajectory.
"""

from __future__ import annotations

from itertools import groupby

from agent_rl.core.renderer import Renderer
from agent_rl.core.types import Trajectory

GREEN, DIM, RESET = "\033[32m", "\033[2m", "\033[0m"


def format_trajectory(traj: Trajectory, renderer: Renderer, title: str = "", color: bool = False) -> str:
    """Each run of equal mask values as one block: `[policy N tok]` for sampled ones, `[context N tok]` else."""
    tools = ", ".join(f"{c.name}:{'ok' if c.ok else 'error'}" for c in traj.tool_calls) or "none"
    head = (f"=== {title or traj.task_id}  reward={traj.reward:g}  stop={traj.stop_reason.value}  "
            f"turns={len(traj.turns)}  tokens={len(traj.token_ids)} (sampled {traj.num_sampled})  "
            f"tools=[{tools}]  policy=v{traj.policy_version} ===")
    lines = [head]
    if traj.error:
        lines.append(f"!!! infrastructure error: {traj.error}")
    pos = 0
    for sampled, run in groupby(zip(traj.token_ids, traj.loss_mask, traj.logprobs), key=lambda x: x[1]):
        block = list(run)
        ids = [b[0] for b in block]
        text = renderer.render_text(ids)
        if sampled:
            mean_lp = sum(b[2] for b in block) / len(block)
            label = f"[policy {len(ids)} tok @ {pos}, mean logprob {mean_lp:.3f}]"
            body = f"{GREEN}{text}{RESET}" if color else text
        else:
            label = f"[context {len(ids)} tok @ {pos}, masked]"
            body = f"{DIM}{text}{RESET}" if color else text
        lines += [label, body]
        pos += len(ids)
    return "\n".join(lines)
