"""Demonstrations for a cold-start SFT: an environment's scripted solver played through the real runner.

Owns: `make_demos` (play `solve` episodes with a `ScriptedSampler` over messages, keep the solved ones), the mix of
tool-using, direct-answer and imperfect demonstrations (one recoverable mistake: the environment's
`mistake` at a random early turn, then `solve` repairs it; the mistake stays in the context with loss
mask 0, so SFT teaches the repair and not the slip), `Demo` (what SFT trains on: ids and loss mask), and
the JSONL file they live in (`write_demos`, `read_demos`).
Does not own: the solvers (each environment's `solve`), rendering (`core.renderers.base`), training on
them (`sft`).

Why through the runner: a demonstration is then a `Trajectory` built by exactly the code that builds
rollouts, so its tokens, template scaffolding and loss mask (tool outputs and prompts 0, the
assistant's turns 1) are the ones GRPO will later train on. Nothing re-renders text for SFT.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from agent_rl.core.files import write_lines
from agent_rl.core.registry import EnvSpec
from agent_rl.core.renderers.base import Renderer
from agent_rl.core.types import Message, Segment, Trajectory
from agent_rl.rollout.engine import Episodes, play_groups
from agent_rl.rollout.players import LocalPlayers
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.rollout.scripted import ScriptedSampler


@dataclass(frozen=True)
class Demo:
    """One demonstration: token ids and the loss mask (1 = the assistant's own tokens)."""

    task_id: str
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]


MISTAKE_TURNS = 3  # an imperfect demonstration errs at one of its first three assistant turns


class _Script:
    """The solver's next reply, except at assistant turn `mistake_at`, where the environment's `mistake`
    answers instead (once; a turn where no mistake fits passes the chance to the next one)."""

    def __init__(self, spec: EnvSpec, task: dict[str, Any], direct: bool, mistake_at: int | None, rng: random.Random):
        self.spec, self.task, self.direct, self.mistake_at, self.rng = spec, task, direct, mistake_at, rng
        self.sampled = 0  # turns sampled so far: the index of the next one in `Trajectory.turns`
        self.slip_turn: int | None = None  # that index for the turn that erred

    @property
    def erred(self) -> bool:
        return self.slip_turn is not None

    def __call__(self, messages: Sequence[Message]) -> Message:
        turn = sum(1 for m in messages if m.role == "assistant")
        self.sampled += 1
        mistake, solve = self.spec.mistake, self.spec.solve
        if mistake is not None and self.mistake_at is not None and not self.erred and turn >= self.mistake_at:
            reply = mistake(self.task, messages, self.rng)
            if reply is not None:
                self.slip_turn = self.sampled - 1
                return reply
        if solve is None:  # make_demos refuses such an environment before playing it
            raise ValueError(f"environment {self.spec.name!r} has no scripted solver")
        return solve(self.task, messages, self.direct)


def _untrain_turn(traj: Trajectory, k: int) -> Trajectory:
    """`traj` with its assistant turn `k` out of the loss (mask and log-probs 0) and still in the context:
    SFT on an imperfect demonstration then learns to repair a slip, not to make it."""
    turn = traj.turns[k]
    seg = traj.all_segments[turn.segment]
    keep = [0 if turn.start <= i < turn.end else m for i, m in enumerate(seg.loss_mask)]
    lps = tuple(lp if m else 0.0 for lp, m in zip(seg.logprobs, keep))
    if turn.segment == len(traj.segments):  # the trajectory's own (last) segment
        return replace(traj, loss_mask=tuple(keep), logprobs=lps)
    segments = list(traj.segments)
    segments[turn.segment] = Segment(seg.token_ids, tuple(keep), lps)
    return replace(traj, segments=tuple(segments))


def _check_shares(spec: EnvSpec, direct_share: float, imperfect_share: float) -> None:
    if spec.solve is None:
        raise ValueError(f"environment {spec.name!r} has no scripted solver (a module-level solve function)")
    for name, share in (("direct_share", direct_share), ("imperfect_share", imperfect_share)):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"{name} must be within [0, 1] (got {share})")
    if direct_share + imperfect_share > 1.0:
        raise ValueError(f"direct_share + imperfect_share must be <= 1 (got {direct_share} + {imperfect_share})")
    if imperfect_share and spec.mistake is None:
        raise ValueError(f"imperfect_share needs a mistake function in environment {spec.name!r} (none defined)")


async def make_demos(spec: EnvSpec, renderer: Renderer, n: int, *, seed: int = 0, direct_share: float = 0.0,
                     imperfect_share: float = 0.0, split: str = "train", limits: EpisodeLimits | None = None,
                     min_reward: float = 1.0) -> tuple[list[Trajectory], dict[str, float]]:
    """Solve `n` tasks of `split`; round(n * direct_share) of them, picked at random, answer directly,
    and round(n * imperfect_share) others make one mistake the solver then repairs.

    Returns the demonstrations whose reward reached `min_reward` (a solver that fails is a bug worth
    seeing, so the count of dropped ones is reported, not hidden) and a few counts.
    """
    _check_shares(spec, direct_share, imperfect_share)
    tasks = spec.load_tasks(n, seed=seed, split=split)
    rng = random.Random(seed)
    direct_ids = {str(t["id"]) for t in rng.sample(tasks, round(len(tasks) * direct_share))}
    rest = [t for t in tasks if str(t["id"]) not in direct_ids]
    imperfect_ids = {str(t["id"]) for t in rng.sample(rest, min(len(rest), round(len(tasks) * imperfect_share)))}
    limits = limits or EpisodeLimits(max_turns=8, max_tokens_per_turn=1024, max_total_tokens=8192)
    demos: list[Trajectory] = []
    dropped = erred = 0
    for task in tasks:
        tid = str(task["id"])
        script = _Script(spec, task, tid in direct_ids, rng.randrange(MISTAKE_TURNS) if tid in imperfect_ids else None,
                         random.Random(f"{seed}-{tid}"))
        sampler = ScriptedSampler(renderer, script, logprob=0.0, on_messages=True)
        [group] = await play_groups([task], Episodes(LocalPlayers(spec.make_env, sampler, renderer), limits, 1))
        traj = group.trajectories[0]
        if traj.infra_error or traj.truncated or traj.reward < min_reward:
            dropped += 1
            continue
        if script.slip_turn is not None:
            traj = _untrain_turn(traj, script.slip_turn)
        demos.append(traj)
        erred += script.erred
    direct_kept = sum(1 for t in demos if t.task_id in direct_ids)
    stats = {"demos": float(len(demos)), "dropped": float(dropped), "direct_share": direct_kept / max(len(demos), 1),
             "imperfect_share": erred / max(len(demos), 1),
             "tool_use_rate": sum(1 for t in demos if t.used_tools) / max(len(demos), 1),
             "tokens_mean": sum(t.num_tokens for t in demos) / max(len(demos), 1)}
    return demos, stats


def demo_lines(demos: Sequence[Trajectory]) -> list[str]:
    """The lines of a demonstrations file: one JSON object per segment with something to train (ids, mask and the
    readable messages)."""
    return [json.dumps({"task_id": t.task_id, "token_ids": list(seg.token_ids), "loss_mask": list(seg.loss_mask),
                        "direct": not t.used_tools, "reward": t.reward,
                        "messages": [{"role": m.role, "content": m.content} for m in t.messages]})
            for t in demos for seg in t.all_segments if seg.num_sampled]


def write_demos(path: str | Path, demos: Sequence[Trajectory]) -> Path:
    """`demo_lines`, written atomically (an interrupted run never leaves a half-written demo file behind)."""
    return write_lines(path, demo_lines(demos))


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
