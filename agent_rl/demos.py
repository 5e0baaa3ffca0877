"""Demonstrations for a cold-start SFT: an environment's scripted solver played through the real runner.

Owns: `make_demos` (play `solve` episodes with a scripted sampler, keep the solved ones), the mix of
tool-using and direct-answer demonstrations, and the JSONL file they live in (`write_demos`,
`read_demos`).
Does not own: the solvers (each environment's `solve`), rendering (`chat`), training on them (`sft`).

Why through the runner: a demonstration is then a `Trajectory` built by exactly the code that builds
rollouts, so its tokens, template scaffolding and loss mask (tool outputs and prompts 0, the
assistant's turns 1) are the ones GRPO will later train on. Nothing re-renders text for SFT.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from agent_rl.chat import ChatRenderer
from agent_rl.rollout import EpisodeLimits, rollout_groups
from agent_rl.sampler import ScriptedSampler
from agent_rl.types import Trajectory
from envs.registry import EnvSpec


@dataclass(frozen=True)
class Demo:
    """One demonstration: token ids and the loss mask (1 = the assistant's own tokens)."""

    task_id: str
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    direct: bool
    reward: float


async def make_demos(spec: EnvSpec, renderer: ChatRenderer, n: int, *, seed: int = 0, direct_share: float = 0.0,
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
    solve = spec.solve
    demos: list[Trajectory] = []
    dropped = 0
    for task in tasks:
        direct = str(task["id"]) in direct_ids
        sampler = ScriptedSampler(renderer.encode, renderer.render_text, renderer.im_end,
                                  lambda text, task=task, direct=direct: solve(task, text, direct), logprob=0.0)
        [group] = await rollout_groups([task], spec.make_env, sampler, renderer, limits, group_size=1)
        traj = group.trajectories[0]
        if traj.infra_error or traj.truncated or traj.reward < min_reward:
            dropped += 1
            continue
        demos.append(traj)
    direct_kept = sum(1 for t in demos if t.task_id in direct_ids)
    stats = {"demos": float(len(demos)), "dropped": float(dropped), "direct_share": direct_kept / max(len(demos), 1),
             "tool_use_rate": sum(1 for t in demos if t.used_tools) / max(len(demos), 1),
             "tokens_mean": sum(len(t.token_ids) for t in demos) / max(len(demos), 1)}
    return demos, stats


def write_demos(path: str | Path, demos: Sequence[Trajectory]) -> Path:
    """One JSON object per line: ids, mask and the readable messages. Written to a temp file, then
    renamed, so an interrupted run never leaves a half-written demo file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for t in demos:
            f.write(json.dumps({
                "task_id": t.task_id, "token_ids": list(t.token_ids), "loss_mask": list(t.loss_mask),
                "direct": not t.used_tools, "reward": t.reward,
                "messages": [{"role": m.role, "content": m.content} for m in t.messages],
            }) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


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
            demos.append(Demo(str(row.get("task_id", i)), ids, mask, bool(row.get("direct", False)),
                              float(row.get("reward", 0.0))))
    if not demos:
        raise ValueError(f"demonstrations file {str(path)!r} is empty")
    return demos
