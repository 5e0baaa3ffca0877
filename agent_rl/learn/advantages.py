"""Advantages: how much better one rollout did than its siblings of the same task.

Owns: the advantage estimators as pure functions over the group axis (`grpo_advantages`,
`dr_grpo_advantages`, `rloo_advantages`), each also as the comparison it makes (`Relative`: a
baseline and a scale), and their one table, `ESTIMATORS`, whose keys are the names `algorithm.advantage`
allows (`learn.algorithm`); and the group-level bookkeeping that decides which
trajectories enter the batch (`group_advantages`): the trajectories whose return is usable enter
their group's statistics (`usable`); groups without variance in their returns are dropped and
counted; the spread the estimator normalised (`GroupAdvantages.spread`). `has_signal` is what
DAPO-style dynamic sampling needs. `CreditRule` / `GroupCredit`: the shape of credit per turn.
Does not own: an episode's return (`core.returns`: the outcome, the turns' rewards and the truncation
rule, stored on each trajectory once its group has ended), credit per turn itself (`learn.credit`),
resampling groups to refill a batch (`rollout.stream`), turning advantages into tensors
(`learn.batching`), the loss (`learn.loss`).

Standard deviation: `grpo_advantages` divides by the *sample* standard deviation (Bessel, N - 1),
which is what torch's default `Tensor.std` gives and therefore what TRL's GRPOTrainer and verl's
GRPO estimator use; the DeepSeekMath paper does not say which. For G = 4 the two differ by a
factor sqrt(4/3); Dr. GRPO and RLOO have no std and are unaffected.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from agent_rl.core.types import Return, Trajectory, TrajectoryGroup

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


def usable(group: TrajectoryGroup) -> tuple[tuple[Trajectory, ...], tuple[Return, ...]]:
    """The trajectories of a group that enter its statistics, and their returns (`Trajectory.ret`, set once the
    group ended: `core.returns`); a trajectory without one is a caller's bug, said in one line."""
    kept: list[Trajectory] = []
    returns: list[Return] = []
    for traj in group.trajectories:
        if traj.ret is None:
            raise ValueError(f"trajectory of task {traj.task_id!r} has no return: its group was never scored "
                             f"(core.returns.scored)")
        if traj.ret.usable:
            kept.append(traj)
            returns.append(traj.ret)
    return tuple(kept), tuple(returns)


def has_signal(group: TrajectoryGroup) -> bool:
    """True when the group's usable returns are not all equal (at least two of them differ).

    A group without that gives every trajectory advantage 0: no gradient, only cost. DAPO's
    dynamic sampling keeps sampling until enough groups have signal.
    """
    _, returns = usable(group)
    return len({r.value for r in returns}) > 1


@dataclass(frozen=True)
class GroupCredit:
    """One group's advantages per turn (`learn.credit`)."""

    turn_advantages: tuple[tuple[float, ...], ...]  # per kept trajectory, one per turn
    turns_in_step_groups: int = 0  # turns that share their start state with another rollout's turn of the group


class CreditRule(Protocol):
    """Per-turn advantages of a group's kept trajectories from their returns and their episode advantages
    (`advantage_fn` over the returns' values): `learn.credit.TurnCredit`."""

    def __call__(self, kept: Sequence[Trajectory], advantages_G: torch.Tensor) -> GroupCredit: ...


@dataclass(frozen=True)
class GroupAdvantages:
    """Which trajectories go into the batch, with their advantages, plus counts for metrics."""

    trajectories: tuple[Trajectory, ...]  # kept ones, in group order then rollout order
    advantages: tuple[float, ...]  # aligned with `trajectories`: each episode's, over its group's returns
    num_groups: int
    num_zero_variance_groups: int  # dropped: no signal (usable returns all equal, and no turn told apart)
    num_truncated: int  # truncated trajectories seen (masked out or given `truncated_reward`)
    num_dropped_trajectories: int  # every trajectory not in the batch, whatever the reason
    # the spread the estimator normalised: over the groups that entered the batch, the mean sample std (N - 1) of
    # their returns' values (0.0: no group entered)
    spread: float = 0.0
    # with credit per turn: aligned with `trajectories`, one advantage per turn; None: every sampled token of
    # a trajectory gets its `advantages` entry (`algorithm.credit: trajectory`)
    turn_advantages: tuple[tuple[float, ...], ...] | None = None
    turns_in_step_groups: int = 0  # turns that share their start state with another rollout's turn of their group


def depends_on(traj: Trajectory, index: int) -> bool:
    """Whether `traj` is a branch that keeps some of the sampled ids of its group's episode `index` (replayed turns
    or a kept part of a turn: `core.types.Branch`), so that its return depends on them."""
    b = traj.branch
    return b is not None and b.source == index and bool(b.replies or b.kept)


def tree_advantages(returns_L: torch.Tensor, excluded_L_L: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Advantages over a group that is a tree (docs/algorithms.md#branching-at-the-tool-decision): each leaf's return
    less the mean return of the leaves its baseline may see, those whose returns do not depend on its own sampled
    ids (`excluded_L_L[l, m]`: leaf m may not enter l's baseline; the diagonal is True), over `scale` (the
    estimator's over all the leaves; None: 1). A leaf whose baseline has no leaf gets 0."""
    seen_L_L = (~excluded_L_L).to(returns_L.dtype)  # [L, L]: 1 where m enters l's baseline
    counts_L = seen_L_L.sum(dim=1)  # [L]
    baseline_L = (seen_L_L @ returns_L) / counts_L.clamp(min=1)  # [L]
    advantages_L = torch.where(counts_L > 0, returns_L - baseline_L, torch.zeros_like(returns_L))
    return advantages_L if scale is None else advantages_L / scale


def _tree(group: TrajectoryGroup, kept: Sequence[Trajectory], returns_L: torch.Tensor,
          advantage_fn: AdvantageFn) -> torch.Tensor:
    """`tree_advantages` for a group with branches, the scale that of the table's estimator `advantage_fn`."""
    estimator = next((e for e in ESTIMATORS.values() if e.advantages is advantage_fn), None)
    if estimator is None:
        raise ValueError(f"a group with branches (algorithm.tool_branches) needs an estimator of the table "
                         f"learn.advantages.ESTIMATORS ({', '.join(ESTIMATORS)}), not {advantage_fn!r}")
    index = {id(t): i for i, t in enumerate(group.trajectories)}
    where = [index[id(t)] for t in kept]
    excluded_L_L = torch.tensor([[m == n or depends_on(t, i) for n, t in zip(where, kept)] for m, i in
                                 zip(where, where)], dtype=torch.bool)
    return tree_advantages(returns_L, excluded_L_L, estimator.relative(returns_L).scale)


def group_advantages(
    groups: Sequence[TrajectoryGroup],
    advantage_fn: AdvantageFn = grpo_advantages,
    credit: CreditRule | None = None,
) -> GroupAdvantages:
    """Apply `advantage_fn` to each group's usable returns; drop groups without signal.

    `advantage_fn` is one of the estimators above (or any function rewards_G -> advantages_G). Which
    trajectories are usable, and their returns, each trajectory carries (`Trajectory.ret`, `core.returns`).
    `credit`: advantages per turn as well (`learn.credit`); None: one per trajectory. With credit, a group whose
    returns are all equal (its episode advantages all 0) stays when some turn's advantage is not 0: the turns' own
    rewards can tell its turns apart (and dropping such a group would bias the estimate, docs/credit.md).
    A group with branches (`rollout.branching`) is a tree: its advantages are `tree_advantages`, and under credit
    per turn each of its turns gets its episode's advantage.
    """
    trajectories: list[Trajectory] = []
    advantages: list[float] = []
    per_turn: list[tuple[float, ...]] = []
    spreads: list[float] = []
    num_zero_variance = num_truncated = num_total = in_step_groups = 0
    for group in groups:
        num_total += len(group.trajectories)
        num_truncated += sum(t.truncated for t in group.trajectories)
        kept, returns = usable(group)
        values = [r.value for r in returns]
        done = _one_group(group, kept, values, advantage_fn, credit)
        if done is None:
            num_zero_variance += 1
            continue
        advantages_G, turns, shared = done
        if turns is not None:
            per_turn.extend(turns)
        in_step_groups += shared
        trajectories.extend(kept)
        advantages.extend(float(a) for a in advantages_G)
        spreads.append(statistics.stdev(values) if len(values) > 1 else 0.0)
    return GroupAdvantages(
        trajectories=tuple(trajectories),
        advantages=tuple(advantages),
        num_groups=len(groups),
        num_zero_variance_groups=num_zero_variance,
        num_truncated=num_truncated,
        num_dropped_trajectories=num_total - len(trajectories),
        turn_advantages=None if credit is None else tuple(per_turn),
        turns_in_step_groups=in_step_groups,
        spread=sum(spreads) / len(spreads) if spreads else 0.0,
    )


def _one_group(group: TrajectoryGroup, kept: Sequence[Trajectory], values: Sequence[float],
               advantage_fn: AdvantageFn, credit: CreditRule | None
               ) -> tuple[torch.Tensor, tuple[tuple[float, ...], ...] | None, int] | None:
    """One group's episode advantages, its turns' (with `credit`) and its turns in step groups; None: no signal."""
    flat = len(set(values)) <= 1  # no episode did better than another
    if flat and (credit is None or len(kept) < 2):
        return None
    rewards_G = torch.tensor(values, dtype=torch.float64)
    tree = any(t.branch is not None for t in kept)
    if flat:
        advantages_G = torch.zeros_like(rewards_G)
    else:
        advantages_G = _tree(group, kept, rewards_G, advantage_fn) if tree else advantage_fn(rewards_G)
    if credit is None:
        return advantages_G, None, 0
    if tree:  # each turn its episode's advantage (a branch's turns before its cut hold no sampled token)
        return advantages_G, tuple((float(a),) * len(t.turns) for t, a in zip(kept, advantages_G)), 0
    done = credit(kept, advantages_G)  # a flat group may still tell turns apart: kept unless every turn gets 0
    if flat and not any(a for turns in done.turn_advantages for a in turns):
        return None
    return advantages_G, done.turn_advantages, done.turns_in_step_groups
