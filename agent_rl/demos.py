"""Demonstrations for a cold-start SFT: an environment's scripted solver played through the real runner.

Owns: `make_demos` (play `solve` episodes with a `ScriptedSampler` over messages, keep the solved ones), the mix of
tool-using and direct-answer demonstrations, `Demo` (what SFT trains on: ids and loss mask), and
the JSONL file they live in (`write_demos`, `read_demos`).
Does not own: the solvers (each environment's `solve`), rendering (`core.renderer`), training on
them (`sft`).

Why through the runner: a demonstration is then a `Trajectory` built by exactly the code that builds
rollouts, so its tokens, template scaffolding and loss mask (tool outputs and prompts 0, the
assistant's turns 1) are the ones GRPO will later train on. Nothing re-renders text for SFT.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from agent_rl.core.files import write_lines
from agent_rl.core.registry import EnvSpec
from agent_rl.core.renderer import Renderer
from agent_rl.core.types import Trajectory
from agent_rl.rollout.runner import EpisodeLimits, rollout_groups
from agent_rl.rollout.scripted import ScriptedSampler


@dataclass(frozen=True)
class Demo:
    """One demonstration: token ids and the loss mask (1 = the assistant's own tokens)."""

    task_id: str
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]


async def make_demos(spec: EnvSpec, renderer: Renderer, n: int, *, seed: int = 0, direct_share: float = 0.0,
                     split: str = "train", limits: EpisodeLimits | None = None,
                     min_reward: float = 1.0) -> tuple[list[Trajectory], dict[str, float]]:
    """Solve `n` tasks of `split`; round(n * direct_share) of them, picked at random, answer directly.

    Returns the demonstrations whose reward reached `min_reward` (a solver that fails is a bug worth
    seeing, so the count of dropped ones is reported, not hidden) and a few counts.
    """
    if spec.solve is None:
        raise ValueError(f"environment {spec.name!r} has no scripted solver (a module-level solve function)")
    if not 0.0 <= direct_share <= 1.0:
        raise ValueError(f"direct_share must be within [0, 1] (got {direct_share})")
    tasks = spec.load_tasks(n, seed=seed, split=split)
    rng = random.Random(seed)
    direct_ids = {str(t["id"]) for t in rng.sample(tasks, round(len(tasks) * direct_share))}
    limits = limits or EpisodeLimits(max_turns=8, max_tokens_per_turn=1024, max_total_tokens=8192)
    demos: list[Trajectory] = []
    dropped = 0
    for task in tasks:
        direct = str(task["id"]) in direct_ids
        def script(messages, task=task, direct=direct):
            return spec.solve(task, messages, direct)

        sampler = ScriptedSampler(renderer, script, logprob=0.0, on_messages=True)
        [group] = await rollout_groups([task], spec.make_env, sampler, renderer, limits, group_size=1)
        traj = group.trajectories[0]
        if traj.infra_error or traj.truncated or traj.reward < min_reward:
            dropped += 1
            continue
        demos.append(traj)
    direct_kept = sum(1 for t in demos if t.task_id in direct_ids)
    stats = {"demos": float(len(demos)), "dropped": float(dropped), "direct_share": direct_kept / max(len(demos), 1),
             "tool_use_rate": sum(1 for t in demos if t.used_tools) / max(len(demos), 1),
             "tokens_mean": sum(t.num_tokens for t in demos) / max(len(demos), 1)}
    return demos, stats


def write_demos(path: str | Path, demos: Sequence[Trajectory]) -> Path:
    """One JSON object per line: ids, mask and the readable messages, written atomically (an
    interrupted run never leaves a half-written demo file behind)."""
    return write_lines(path, (json.dumps({  # a trajectory of several segments: a line per segment
        "task_id": t.task_id, "token_ids": list(seg.token_ids), "loss_mask": list(seg.loss_mask),
        "direct": not t.used_tools, "reward": t.reward,
        "messages": [{"role": m.role, "content": m.content} for m in t.messages],
    }) for t in demos for seg in t.all_segments))


def read_demos(path: str | Path) -> list[Demo]:
    """Demonstrations from a file `write_demos` wrote; a broken line is a one-line error naming it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"demonstrations file {str(path)!r} not found (make it with `agent-rl demos`)")
    demos = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row: dict[str, Any] = json.loads(line)
                ids, mask = tuple(int(x) for x in row["token_ids"]), tuple(int(x) for x in row["loss_mask"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{i}: not a demonstration ({type(e).__name__}: {e})") from None
            if len(ids) != len(mask) or not any(mask) or set(mask) - {0, 1}:
                raise ValueError(f"{path}:{i}: token_ids and loss_mask must have the same length and "
                                 f"the mask must be 0/1 with at least one 1")
            demos.append(Demo(str(row.get("task_id", i)), ids, mask))
    if not demos:
        raise ValueError(f"demonstrations file {str(path)!r} is empty")
    return demos
