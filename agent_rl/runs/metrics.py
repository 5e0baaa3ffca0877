"""Rollout metrics: what the policy did with its tools, as flat name -> number dictionaries.

Owns: `rollout_metrics(trajectories)`, a pure function (tool-use rate, calls per trajectory,
per-tool call and failure rates, turns, lengths, truncation rate, stop reasons, infra errors, the
turns' own rewards by part, `turn_reward_metrics`), and in a run of several environments the main
figures of each (`env/<name>/...`, `env_metrics`); by group, whether the policy tries its tools
(`tool_decision_metrics`) and what the branches at the tool decision cost and gave (`branch_metrics`); the
policy's violations of the call format, per sampled turn (`reply_violations`, `violation_metrics`).
Does not own: training metrics (the loss returns its own), logging to files (`runs.runlog`).

Infrastructure errors are counted but kept out of every behavioural rate: a dead server is not a
policy that stopped calling tools. Every rate and mean is per rollout: `reward_mean` is the mean of the
episodes' outcomes whatever the credit assignment, and turn rewards are summed within a rollout first.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from statistics import fmean

from agent_rl.core.types import EPISODE_REWARD, Message, StopReason, Trajectory, TrajectoryGroup

# the figures given per environment (`env/<name>/<figure>`) in a run of several
ENV_FIGURES = ("rollouts", "infra_error_rate", "reward_mean", "accuracy", "tool_use_rate", "tool_calls_per_traj",
               "truncation_rate", "sampled_tokens_mean")


def _mean(xs: Sequence[float]) -> float:
    return fmean(xs) if xs else 0.0


def solved(t: Trajectory, success_threshold: float = 1.0) -> bool:
    """The episode's own reward (before any group reward) reaches the threshold."""
    return t.reward_parts.get(EPISODE_REWARD, t.reward) >= success_threshold


def env_metrics(trajectories: Sequence[Trajectory], success_threshold: float = 1.0) -> dict[str, float]:
    """`env/<name>/<figure>` for each environment the trajectories came from (`Trajectory.env`); {} when none
    is named (a run of one environment: its figures are the run's)."""
    out: dict[str, float] = {}
    for name in sorted({t.env for t in trajectories} - {""}):
        mine = [t for t in trajectories if t.env == name]
        figures = _rates(mine)
        if ok := [t for t in mine if not t.infra_error]:
            figures["accuracy"] = _mean([1.0 if solved(t, success_threshold) else 0.0 for t in ok])
        out.update({f"env/{name}/{k}": figures[k] for k in ENV_FIGURES if k in figures})
    return out


def rollout_metrics(trajectories: Sequence[Trajectory], success_threshold: float | None = None) -> dict[str, float]:
    """Behavioural rates of the trajectories; with `success_threshold`, also each environment's figures."""
    m = _rates(trajectories)
    if success_threshold is not None:
        m.update(env_metrics(trajectories, success_threshold))
    return m


def _rates(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    total = len(trajectories)
    ok = [t for t in trajectories if not t.infra_error]
    m: dict[str, float] = {
        "rollouts": float(total),
        "infra_error_rate": (total - len(ok)) / total if total else 0.0,
    }
    if not ok:
        return m
    calls = [c for t in ok for c in t.tool_calls]
    m.update({
        "reward_mean": _mean([t.reward for t in ok]),
        "tool_use_rate": _mean([1.0 if t.used_tools else 0.0 for t in ok]),
        "tool_calls_per_traj": len(calls) / len(ok),
        "tool_failure_rate": _mean([0.0 if c.ok else 1.0 for c in calls]),
        "turns_mean": _mean([len(t.turns) for t in ok]),
        "tokens_mean": _mean([t.num_tokens for t in ok]),  # every segment's tokens
        "segments_mean": _mean([len(t.segments) + 1 for t in ok]),
        "sampled_tokens_mean": _mean([t.num_sampled for t in ok]),
        "truncation_rate": _mean([1.0 if t.truncated else 0.0 for t in ok]),
        # scoring runs inside the rollouts, concurrently: this is its summed time, not wall time
        "reward_time_sum_s": sum(t.reward_s for t in ok),
    })
    for name, n in sorted(Counter(c.name for c in calls).items()):
        failed = sum(1 for c in calls if c.name == name and not c.ok)
        m[f"tool/{name}/calls_per_traj"] = n / len(ok)
        m[f"tool/{name}/failure_rate"] = failed / n
        m[f"tool/{name}/latency_mean_s"] = _mean([c.latency_s for c in calls if c.name == name])
    stops = Counter(t.stop_reason for t in trajectories)
    for reason in StopReason:
        m[f"stop/{reason.value}"] = stops.get(reason, 0) / total
    parts = sorted({k for t in ok for k in t.reward_parts})
    for k in parts:
        m[f"reward/{k}"] = _mean([t.reward_parts.get(k, 0.0) for t in ok])
    m.update(turn_reward_metrics(ok))
    return m


def turn_reward_metrics(ok: Sequence[Trajectory]) -> dict[str, float]:
    """The turns' own rewards (`core.types.Turn`) summed per rollout, then averaged over rollouts (never
    over turns, whose number varies): `turn_reward_mean` and `turn_reward/<part>`; {} when no turn has any."""
    if not any(turn.reward or turn.reward_parts for t in ok for turn in t.turns):
        return {}
    m = {"turn_reward_mean": _mean([t.turn_reward for t in ok])}
    for k in sorted({k for t in ok for turn in t.turns for k in turn.reward_parts}):
        m[f"turn_reward/{k}"] = _mean([sum(turn.reward_parts.get(k, 0.0) for turn in t.turns) for t in ok])
    return m


def lag_metrics(trajectories: Sequence[Trajectory], step: int) -> dict[str, float]:
    """How many policy versions behind the trainer (at `step`: the weights after `step` optimizer steps) the
    sampled tokens of the trajectories are: `lag/mean`, `lag/max`, and `lag/share_<n>` for each lag seen. Each
    token counts with the version that sampled it (`Trajectory.versions`: a push in the middle of a turn gives
    its later tokens the newer version); one whose version is not known, with the trajectory's."""
    tokens: Counter[int] = Counter()
    for t in trajectories:
        for seg in t.all_segments:
            for version, sampled in zip(seg.versions, seg.loss_mask):
                if sampled:
                    tokens[step - (version if version >= 0 else t.policy_version)] += 1
    total = sum(tokens.values())
    if not total:
        return {}
    return {"lag/mean": sum(lag * n for lag, n in tokens.items()) / total, "lag/max": float(max(tokens)),
            **{f"lag/share_{lag}": n / total for lag, n in sorted(tokens.items())}}


def tool_decision_metrics(groups: Sequence[TrajectoryGroup], success_threshold: float = 1.0) -> dict[str, float]:
    """Whether the policy tries its tools, by group (the groups' own episodes: branches are not the policy's own
    choice, `branch_metrics`): `tool/attempt_share` (rollouts that attempt a call, well formed or not),
    `tool/no_attempt_groups` (groups where no rollout attempted one), `tool/all_fail_groups` (groups whose
    tool-using rollouts all failed: the call gets no positive signal), each a share of the groups with a rollout that
    played; `reward/with_tools` and `reward/without_tools` (the mean outcome of the rollouts that attempted a call and
    of those that did not; absent when there are none)."""
    own = [[t for t in g.trajectories if t.branch is None and not t.infra_error] for g in groups]
    own = [g for g in own if g]
    if not own:
        return {}
    rollouts = [t for g in own for t in g]
    attempted = [t for t in rollouts if t.used_tools]
    out = {"tool/attempt_share": len(attempted) / len(rollouts),
           "tool/no_attempt_groups": _mean([0.0 if any(t.used_tools for t in g) else 1.0 for g in own]),
           "tool/all_fail_groups": _mean([1.0 if (tried := [t for t in g if t.used_tools]) and not any(
               solved(t, success_threshold) for t in tried) else 0.0 for g in own])}
    if attempted:
        out["reward/with_tools"] = _mean([t.reward for t in attempted])
    if len(attempted) < len(rollouts):
        out["reward/without_tools"] = _mean([t.reward for t in rollouts if not t.used_tools])
    return out


def branch_metrics(groups: Sequence[TrajectoryGroup], success_threshold: float = 1.0) -> dict[str, float]:
    """What the branches at the tool decision cost and gave (`rollout.branching`): `branch/episodes`, their share of
    the step's episodes (`branch/share`) and of its sampled tokens (`branch/token_share`), the groups that branched
    (`branch/groups`), and of the branches that played: the share that attempted a call (`branch/attempt_share`) and
    that solved their task (`branch/solved_share`); {} when the run does not branch."""
    trajs = [t for g in groups for t in g.trajectories]
    branched = [t for t in trajs if t.branch is not None]
    if not branched:
        return {}
    played = [t for t in branched if not t.infra_error]
    sampled = sum(t.num_sampled for t in trajs)
    return {"branch/episodes": float(len(branched)), "branch/share": len(branched) / len(trajs),
            "branch/token_share": sum(t.num_sampled for t in branched) / sampled if sampled else 0.0,
            "branch/groups": float(sum(any(t.branch is not None for t in g.trajectories) for g in groups)),
            "branch/attempt_share": _mean([1.0 if t.used_tools else 0.0 for t in played]),
            "branch/solved_share": _mean([1.0 if solved(t, success_threshold) else 0.0 for t in played])}


# what `violation_metrics` counts, each a share of the sampled turns (`violation/<name>`)
VIOLATIONS = ("call_in_reasoning", "malformed_call", "unknown_tool", "call_after_answer")
_ANSWERED = re.compile(r"<answer>.*?</answer>|\\boxed\{", re.DOTALL)
CALL_TAG = "<tool_call>"


def reply_violations(reply: Message, tools: Sequence[str] | None,
                     calls_in_reasoning: Callable[[str], int] = lambda text: 0) -> dict[str, bool]:
    """What a sampled reply did wrong: a call written inside its reasoning (`calls_in_reasoning`, the renderer's:
    the family does not read it), a call the parser could not read, a readable call naming none of `tools` (None:
    not known, not checked), a call after the reply stated its final answer (an `<answer>...</answer>` or a
    `\\boxed{` before the first `<tool_call>`; a reply of bare calls states nothing before them)."""
    readable = [c for c in reply.tool_calls if c.ok]
    first_call = reply.content.find(CALL_TAG) if reply.tool_calls else -1
    before = reply.content[:first_call] if first_call >= 0 else ""
    return {"call_in_reasoning": calls_in_reasoning(reply.content) > 0,
            "malformed_call": len(readable) < len(reply.tool_calls),
            "unknown_tool": tools is not None and any(c.name not in tools for c in readable),
            "call_after_answer": bool(_ANSWERED.search(before))}


def sampled_replies(traj: Trajectory) -> list[Message]:
    """The policy's own replies: the last `len(turns)` assistant messages (a prompt may hold earlier ones)."""
    replies = [m for m in traj.messages if m.role == "assistant"]
    return replies[len(replies) - len(traj.turns):] if traj.turns else []


def violation_metrics(trajectories: Sequence[Trajectory],
                      calls_in_reasoning: Callable[[str], int] = lambda text: 0) -> dict[str, float]:
    """`violation/<name>` for each of VIOLATIONS: the share of the sampled turns (of the episodes without an
    infrastructure error) with that violation (`reply_violations`), and `violation/any`, with at least one; {}
    when no turn was sampled."""
    found = [reply_violations(m, t.tools, calls_in_reasoning) for t in trajectories if not t.infra_error
             for m in sampled_replies(t)]
    if not found:
        return {}
    out = {f"violation/{name}": _mean([1.0 if f[name] else 0.0 for f in found]) for name in VIOLATIONS}
    return {**out, "violation/any": _mean([1.0 if any(f.values()) else 0.0 for f in found])}
