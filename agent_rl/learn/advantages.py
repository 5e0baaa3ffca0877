"""Advantages: how much better one rollout did than its siblings of the same task.

Owns: the advantage estimators as pure functions over the group axis (`grpo_advantages`,
`dr_grpo_advantages`, `rloo_advantages`), each also as the comparison it makes (`Relative`: a
baseline and a scale), and their one table, `ESTIMATORS`, whose keys are the names `algorithm.advantage`
allows (`learn.algorithm`); and the group-level bookkeeping that decides which
trajectories enter the batch (`group_advantages`): infrastructure errors and, optionally,
truncated episodes are kept out of the group statistics; groups without variance in their
returns (outcome + turn rewards) are dropped and counted. `usable_rewards` / `has_signal` are what
DAPO-style dynamic sampling needs. `CreditRule` / `GroupCredit`: the shape of credit per turn.
Does not own: credit per turn itself (`learn.credit`), resampling groups to refill a batch (the
training loop), turning advantages into tensors (`learn.batching`), the loss (`learn.loss`).

Standard deviation: `grpo_advantages` divides by the *sample* standard deviation (Bessel, N - 1),
which is what torch's default `Tensor.std` gives and therefore what TRL's GRPOTrainer and verl's
GRPO estimator use; the DeepSeekMath paper does not say which. For G = 4 the two differ by a
factor sqrt(4/3); Dr. GRPO and RLOO have no std and are unaffected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, cast

import torch

from agent_rl.core.types import Trajectory, TrajectoryGroup

AdvantageFn = Callable[[torch.Tensor], torch.Tensor]


def _as_rewards(rewards_G: Sequence[float] | torch.Tensor) -> torch.Tensor:
    if isinstance(rewards_G, torch.Tensor) and rewards_G.is_floating_point():
        rewards = rewards_G
    else:
        rewards = torch.as_tensor(rewards_G, dtype=torch.float32)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (one group), got shape {tuple(rewards.shape)}")
    return rewards


@dataclass(frozen=True)
class Relative:
    """An estimator as a comparison: advantage_G = (rewards_G - baseline_G) / scale. Credit per turn
    (`learn.credit`) compares each turn's return with the same baseline and scale."""

    baseline_G: torch.Tensor  # one per rollout, or one for all (a 0-dim tensor)
    scale: torch.Tensor | None = None  # None: no division


def compare(values: torch.Tensor, rel: Relative) -> torch.Tensor:
    """(values - baseline) / scale, elementwise (the estimator's own arithmetic, in its order)."""
    diff = values - rel.baseline_G
    return diff if rel.scale is None else diff / rel.scale


def dr_grpo_relative(rewards_G: Sequence[float] | torch.Tensor) -> Relative:
    """Dr. GRPO compares with the group mean and does not scale."""
    rewards = _as_rewards(rewards_G)
    return Relative(rewards.mean())


def grpo_relative(rewards_G: Sequence[float] | torch.Tensor, eps: float = 1e-6) -> Relative:
    """GRPO compares with the group mean, in units of the sample std (+ eps)."""
    rewards = _as_rewards(rewards_G)
    return Relative(rewards.mean(), rewards.std(unbiased=True) + eps)


def rloo_relative(rewards_G: Sequence[float] | torch.Tensor) -> Relative:
    """RLOO compares each rollout with the mean of the other G - 1 (a baseline independent of its own)."""
    rewards = _as_rewards(rewards_G)
    return Relative((rewards.sum() - rewards) / (rewards.numel() - 1))


def dr_grpo_advantages(rewards_G: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: r - mean(r). No std division, which would up-weight near-uniform groups."""
    rewards = _as_rewards(rewards_G)
    if rewards.numel() < 2:  # nothing to compare against: no signal
        return torch.zeros_like(rewards)
    return compare(rewards, dr_grpo_relative(rewards))


def grpo_advantages(rewards_G: Sequence[float] | torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - mean(r)) / (std(r) + eps), std being the sample std (N - 1), as TRL and verl."""
    rewards = _as_rewards(rewards_G)
    if rewards.numel() < 2:  # the sample std of one value is undefined
        return torch.zeros_like(rewards)
    return compare(rewards, grpo_relative(rewards, eps))


def rloo_advantages(rewards_G: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """RLOO: r_i minus the mean of the other G - 1 rewards (a baseline independent of r_i)."""
    rewards = _as_rewards(rewards_G)
    if rewards.numel() < 2:
        return torch.zeros_like(rewards)
    return compare(rewards, rloo_relative(rewards))


class Estimator(NamedTuple):
    """One `algorithm.advantage`: its function over the group axis, and the comparison it makes."""

    advantages: AdvantageFn
    relative: Callable[[torch.Tensor], Relative]  # credit per turn compares each turn's return the same way


ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(grpo_advantages, grpo_relative),
    "dr_grpo": Estimator(dr_grpo_advantages, dr_grpo_relative),
    "rloo": Estimator(rloo_advantages, rloo_relative),
}


# --- group level ---------------------------------------------------------------------------


def usable_outcome(traj: Trajectory, truncated_reward: float | None = None) -> float | None:
    """The episode's outcome as its group's statistics see it; None when it does not enter them.

    Infrastructure errors never do: their reward says nothing about the policy. Truncated
    episodes (cut by a length limit) are left out too when `truncated_reward` is None (masked out
    of the loss, as DAPO's overlong filtering: the episode never got to answer, so its reward is
    not evidence either way); otherwise they stay in with `truncated_reward` as their outcome.
    """
    if traj.infra_error:
        return None
    if traj.truncated:
        return None if truncated_reward is None else float(truncated_reward)
    return float(traj.reward)


def usable_rewards(
    group: TrajectoryGroup, truncated_reward: float | None = None
) -> tuple[tuple[Trajectory, ...], tuple[float, ...]]:
    """The trajectories of a group that enter its statistics (`usable_outcome`), and their episode
    returns: the outcome plus the turns' own rewards (`Trajectory.turn_reward`; none: the outcome)."""
    kept: list[Trajectory] = []
    rewards: list[float] = []
    for traj in group.trajectories:
        outcome = usable_outcome(traj, truncated_reward)
        if outcome is None:
            continue
        kept.append(traj)
        rewards.append(outcome + traj.turn_reward)
    return tuple(kept), tuple(rewards)


def has_signal(group: TrajectoryGroup, truncated_reward: float | None = None) -> bool:
    """True when the group's usable returns are not all equal (at least two of them differ).

    A group without that gives every trajectory advantage 0: no gradient, only cost. DAPO's
    dynamic sampling keeps sampling until enough groups have signal.
    """
    _, rewards = usable_rewards(group, truncated_reward)
    return len(set(rewards)) > 1


@dataclass(frozen=True)
class GroupCredit:
    """One group's advantages per turn (`learn.credit`)."""

    turn_advantages: tuple[tuple[float, ...], ...]  # per kept trajectory, one per turn
    turns_in_step_groups: int = 0  # turns that share their start state with another turn of the group


class CreditRule(Protocol):
    """Per-turn advantages of a group's kept trajectories from their usable outcomes and their episode
    advantages (`advantage_fn` over their returns): `learn.credit.TurnCredit`."""

    def __call__(self, kept: Sequence[Trajectory], outcomes: Sequence[float],
                 advantages_G: torch.Tensor) -> GroupCredit: ...


@dataclass(frozen=True)
class GroupAdvantages:
    """Which trajectories go into the batch, with their advantages, plus counts for metrics."""

    trajectories: tuple[Trajectory, ...]  # kept ones, in group order then rollout order
    advantages: tuple[float, ...]  # aligned with `trajectories`: each episode's, over its group's returns
    num_groups: int
    num_zero_variance_groups: int  # dropped: no signal (usable returns all equal, and no turn told apart)
    num_truncated: int  # truncated trajectories seen (masked out or given `truncated_reward`)
    num_dropped_trajectories: int  # every trajectory not in the batch, whatever the reason
    # with credit per turn: aligned with `trajectories`, one advantage per turn; None: every sampled token of
    # a trajectory gets its `advantages` entry (`algorithm.credit: trajectory`)
    turn_advantages: tuple[tuple[float, ...], ...] | None = None
    turns_in_step_groups: int = 0  # turns that share their start state with another of their group's turns


def group_advantages(
    groups: Sequence[TrajectoryGroup],
    advantage_fn: AdvantageFn = grpo_advantages,
    truncated_reward: float | None = None,
    credit: CreditRule | None = None,
) -> GroupAdvantages:
    """Apply `advantage_fn` to each group's usable returns; drop groups without signal.

    `advantage_fn` is one of the estimators above (or any function rewards_G -> advantages_G).
    `truncated_reward`: None masks truncated episodes out of statistics and loss; a number keeps
    them with that reward (a failure reward, e.g. 0.0). `credit`: advantages per turn as well
    (`learn.credit`); None: one per trajectory. With credit, a group whose returns are all equal (its
    episode advantages all 0) stays when some turn's advantage is not 0: the turns' own rewards can
    tell its turns apart (and dropping such a group would bias the estimate, docs/credit.md).
    """
    trajectories: list[Trajectory] = []
    advantages: list[float] = []
    per_turn: list[tuple[float, ...]] = []
    num_zero_variance = num_truncated = num_total = in_step_groups = 0
    for group in groups:
        num_total += len(group.trajectories)
        num_truncated += sum(t.truncated for t in group.trajectories)
        kept, rewards = usable_rewards(group, truncated_reward)
        flat = len(set(rewards)) <= 1  # no episode did better than another
        if flat and (credit is None or len(kept) < 2):
            num_zero_variance += 1
            continue
        rewards_G = torch.tensor(rewards, dtype=torch.float64)
        advantages_G = torch.zeros_like(rewards_G) if flat else advantage_fn(rewards_G)
        if credit is not None:  # a flat group may still tell turns apart: kept unless every turn gets 0
            outcomes = [cast(float, usable_outcome(t, truncated_reward)) for t in kept]
            done = credit(kept, outcomes, advantages_G)
            if flat and not any(a for turns in done.turn_advantages for a in turns):
                num_zero_variance += 1
                continue
            per_turn.extend(done.turn_advantages)
            in_step_groups += done.turns_in_step_groups
        trajectories.extend(kept)
        advantages.extend(float(a) for a in advantages_G)
    return GroupAdvantages(
        trajectories=tuple(trajectories),
        advantages=tuple(advantages),
        num_groups=len(groups),
        num_zero_variance_groups=num_zero_variance,
        num_truncated=num_truncated,
        num_dropped_trajectories=num_total - len(trajectories),
        turn_advantages=None if credit is None else tuple(per_turn),
        turns_in_step_groups=in_step_groups,
    )
