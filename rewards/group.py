"""Group-level rewards: scores given to the G trajectories of one task together, once all of them ended.

Owns: the hook's shape (`GroupReward`: `(task, trajectories) -> one float or Reward per trajectory`,
or None for nothing), `rubric_group_reward` (a `Rubric`'s group terms, TRL-style functions called once
with the G completions of a task, as a hook), `judge_group_reward` (an `LLMJudge`'s ranking as a hook
that also reports whether the judge could judge), `combine_group_rewards` (several hooks, their
rewards summed) and `conversation` (a finished trajectory as TRL prompt and completion message dicts).
Does not own: when a hook is called and how its rewards join the episode's (`rollout.runner.score_group`),
the judge (`rewards.judge`), per-episode terms (`Rubric.score`, called by the environment).

Rewards follow the rubric's rule: a hook's value is added to the episode's reward as it is (weights
already applied), and its parts are logged by name, unweighted.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from agent_rl.core.types import Message, Reward, Trajectory
from agent_rl.rewards.judge import LLMJudge, question_of
from agent_rl.rewards.rubric import Messages, Rubric, final_reply

GroupReward = Callable[[dict[str, Any], Sequence[Trajectory]],
                       Sequence[float | Reward] | None | Awaitable[Sequence[float | Reward] | None]]


def _as_dict(m: Message) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name is not None:
        d["name"] = m.name
    return d


def conversation(t: Trajectory) -> tuple[Messages, Messages]:
    """(prompt, completion) as message dicts. The completion starts at the first sampled turn: the last
    len(t.turns) assistant messages are the policy's, any before them (few-shot examples) the prompt's."""
    assistant = [i for i, m in enumerate(t.messages) if m.role == "assistant"]
    start = assistant[len(assistant) - len(t.turns)] if t.turns and len(assistant) >= len(t.turns) else len(t.messages)
    return [_as_dict(m) for m in t.messages[:start]], [_as_dict(m) for m in t.messages[start:]]


def rubric_group_reward(rubric: Rubric) -> GroupReward:
    """The group terms of `rubric` as a hook; the task's columns (all but "prompt") go to them by name.
    A module that builds its environments with `rubric` exposes it as `group_reward = rubric_group_reward(RUBRIC)`."""
    if not rubric.group_terms:
        raise ValueError("this rubric has no group terms (RewardTerm(fn, weight, name, group=True))")

    async def group_reward(task: dict[str, Any], trajectories: Sequence[Trajectory]) -> list[Reward]:
        talks = [conversation(t) for t in trajectories]
        columns = {k: v for k, v in task.items() if k != "prompt"}
        scores = await rubric.score_group([p for p, _ in talks], [c for _, c in talks], **columns)
        return [Reward(s.total, s.parts) for s in scores]

    return group_reward


def judge_group_reward(judge: LLMJudge, weight: float) -> GroupReward:
    """reward += weight x the judge's score (1 best .. 0 worst); parts `<name>` (the score) and
    `<name>_failed` (1 where the judge could not judge and scored the group neutral)."""

    async def group_reward(task: dict[str, Any], trajectories: Sequence[Trajectory]) -> list[Reward]:
        talks = [conversation(t) for t in trajectories]
        ref = task.get(judge.reference) if judge.reference else None
        verdict = await judge.judge(question_of(talks[0][0]), [final_reply(c) for _, c in talks],
                                    None if ref is None else str(ref))
        failed = 0.0 if verdict.ok else 1.0
        return [Reward(weight * s, {judge.name: s, f"{judge.name}_failed": failed}) for s in verdict.scores]

    return group_reward


def combine_group_rewards(*hooks: GroupReward | None) -> GroupReward | None:
    """One hook calling each of `hooks` (None entries ignored) and summing their rewards; None if none."""
    present = [h for h in hooks if h is not None]
    if len(present) <= 1:
        return present[0] if present else None

    async def group_reward(task: dict[str, Any], trajectories: Sequence[Trajectory]) -> list[Reward] | None:
        total: list[Reward] | None = None
        for hook in present:
            out = hook(task, trajectories)
            out = await out if inspect.isawaitable(out) else out
            if out is None:
                continue
            rewards = [r if isinstance(r, Reward) else Reward(float(r)) for r in out]
            if len(rewards) != len(trajectories):
                raise ValueError(f"{getattr(hook, '__name__', 'a group reward')} gave {len(rewards)} rewards "
                                 f"for {len(trajectories)} trajectories")
            total = rewards if total is None else [Reward(a.value + b.value, {**a.parts, **b.parts})
                                                   for a, b in zip(total, rewards)]
        return total

    return group_reward
