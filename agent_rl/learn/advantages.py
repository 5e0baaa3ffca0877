"""Advantages: how much better one rollout did than its siblings of the same task.

Owns: the advantage estimators as pure functions over the group axis (`grpo_advantages`,
`dr_grpo_advantages`, `rloo_advantages`) and the group-level bookkeeping that decides which
trajectories enter the batch (`group_advantages`): infrastructure errors and, optionally,
truncated episodes are kept out of the group statistics; groups without reward variance are
dropped and counted. `usable_rewards` / `has_signal` are what DAPO-style dynamic sampling needs.
Does not own: resampling groups to refill a batch (the training loop), turning advantages into
tensors (`learn.batching`), the loss (`learn.loss`).

Standard deviation: `grpo_advantages` divides by the *sample* standard deviation (Bessel, N - 1),
which is what torch's default `Tensor.std` gives and therefore what TRL's GRPOTrainer and verl's
GRPO estimator use; the DeepSeekMath paper does not say which. For G = 4 the two differ by a
factor sqrt(4/3); Dr. GRPO and RLOO have no std and are unaffected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


def dr_grpo_advantages(rewards_G: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: r - mean(r). No std division, which would up-weight near-uniform groups."""
    rewards = _as_rewards(rewards_G)
    if rewards.numel() < 2:  # nothing to compare against: no signal
        return torch.zeros_like(rewards)
    return rewards - rewards.mean()


def grpo_advantages(rewards_G: Sequence[float] | torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - mean(r)) / (std(r) + eps), std being the sample std (N - 1), as TRL and verl."""
    rewards = _as_rewards(rewards_G)
    if rewards.numel() < 2:  # the sample std of one value is undefined
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std(unbiased=True) + eps)


def rloo_advantages(rewards_G: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """RLOO: r_i minus the mean of the other G - 1 rewards (a baseline independent of r_i)."""
    rewards = _as_rewards(rewards_G)
    g = rewards.numel()
    if g < 2:
        return torch.zeros_like(rewards)
    mean_of_others = (rewards.sum() - rewards) / (g - 1)
    return rewards - mean_of_others


# --- group level ---------------------------------------------------------------------------


def usable_rewards(
    group: TrajectoryGroup, truncated_reward: float | None = None
) -> tuple[tuple[Trajectory, ...], tuple[float, ...]]:
    """The trajectories of a group that enter its statistics, and their rewards.

    Infrastructure errors never do: their reward says nothing about the policy. Truncated
    episodes (cut by a length limit) are left out too when `truncated_reward` is None (masked out
    of the loss, as DAPO's overlong filtering: the episode never got to answer, so its reward is
    not evidence either way); otherwise they stay in with `truncated_reward` as their reward.
    """
    kept: list[Trajectory] = []
    rewards: list[float] = []
    for traj in group.trajectories:
        if traj.infra_error:
            continue
        if traj.truncated:
            if truncated_reward is None:
                continue
            kept.append(traj)
            rewards.append(float(truncated_reward))
            continue
        kept.append(traj)
        rewards.append(float(traj.reward))
    return tuple(kept), tuple(rewards)


def has_signal(group: TrajectoryGroup, truncated_reward: float | None = None) -> bool:
    """True when the group's usable rewards are not all equal (at least two of them differ).

    A group without that gives every trajectory advantage 0: no gradient, only cost. DAPO's
    dynamic sampling keeps sampling until enough groups have signal.
    """
    _, rewards = usable_rewards(group, truncated_reward)
    return len(set(rewards)) > 1


@dataclass(frozen=True)
class GroupAdvantages:
    """Which trajectories go into the batch, with their advantages, plus counts for metrics."""

    trajectories: tuple[Trajectory, ...]  # kept ones, in group order then rollout order
    advantages: tuple[float, ...]  # aligned with `trajectories`
    num_groups: int
    num_zero_variance_groups: int  # dropped: usable rewards all equal (or fewer than two usable)
    num_truncated: int  # truncated trajectories seen (masked out or given `truncated_reward`)
    num_dropped_trajectories: int  # every trajectory not in the batch, whatever the reason


def group_advantages(
    groups: Sequence[TrajectoryGroup],
    advantage_fn: AdvantageFn = grpo_advantages,
    truncated_reward: float | None = None,
) -> GroupAdvantages:
    """Apply `advantage_fn` to each group's usable rewards; drop groups without signal.

    `advantage_fn` is one of the estimators above (or any function rewards_G -> advantages_G).
    `truncated_reward`: None masks truncated episodes out of statistics and loss; a number keeps
    them with that reward (a failure reward, e.g. 0.0).
    """
    trajectories: list[Trajectory] = []
    advantages: list[float] = []
    num_zero_variance = num_truncated = num_total = 0
    for group in groups:
        num_total += len(group.trajectories)
        num_truncated += sum(t.truncated for t in group.trajectories)
        kept, rewards = usable_rewards(group, truncated_reward)
        if len(set(rewards)) <= 1:
            num_zero_variance += 1
            continue
        advantages_G = advantage_fn(torch.tensor(rewards, dtype=torch.float64))
        trajectories.extend(kept)
        advantages.extend(float(a) for a in advantages_G)
    return GroupAdvantages(
        trajectories=tuple(trajectories),
        advantages=tuple(advantages),
        num_groups=len(groups),
        num_zero_variance_groups=num_zero_variance,
        num_truncated=num_truncated,
        num_dropped_trajectories=num_total - len(trajectories),
    )
