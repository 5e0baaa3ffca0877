"""Credit per turn: which advantage each turn of an episode gets (`algorithm.credit`).

Owns: each turn's return (`turn_returns`); the rules that give each turn an advantage of its own,
`turn` (`turn_credit`) and `gigpo` (`gigpo_credit`, with its step groups, `step_groups`, and each turn's step
advantage within one, `step_advantages`); their one table, `CREDITS`, beside `trajectory` (no rule: every token gets
its episode's advantage), whose keys are the names `algorithm.credit` allows; a rule with its settings
(`TurnCredit`: `learn.advantages.CreditRule`); and its figures (`credit_metrics`).
Does not own: the estimators and the group bookkeeping (`learn.advantages`: which trajectories enter,
their episode advantages), the turns' rewards and start states (the runner records them on each
`core.types.Turn`), what each turn's reward and the outcome count for in the return (`core.returns`, stored as
`Trajectory.ret`), tokens (`learn.batching` gives every token of a turn that turn's advantage), the rule
a config asks for (`learn.algorithm.credit_of`).

Notation: a group's kept rollouts i, each with turns t = 0 .. T_i - 1, turn rewards r_it counted k_i r_it, outcome
R_i (`Return.outcome`, `Return.share`: core.returns, where k is 1 but for failures and truncations), discount gamma.

    return       G_it = k_i r_it + gamma G_i,t+1,   G_i,T-1 = k_i r_i,T-1 + R_i  (where k_i is not 1, plus what the
                 turns before t were paid beyond what they count for: `turn_returns`)
    trajectory   A_it = f(E)_i for every t: f the estimator over the episode returns E_i = R_i + k_i sum_t r_it
    turn         A_it = (G_it - b_i) / s, with (b, s) the estimator's baseline and scale over G_i0
    gigpo        A_it = f(E)_i + step_weight (G_it - b_i(s)) / s(s), with (b, s) the estimator's baseline and scale
                 over the group's rollouts that start a turn from s, turn it's state, each by its first G there

GiGPO (Feng et al., 2025) as its paper writes it: E_i the episode's undiscounted total (its Eq. 3), G_it the
discounted return from the turn on with the outcome as the last turn's reward (Eq. 5), step groups of the turns of
one task's group, across rollouts and turn indices, whose start states are equal exactly (Eq. 6), the same
estimator at both levels (its F_norm: the std for grpo, 1 for dr_grpo), A = A^E + step_weight A^S (Eq. 8; the
paper's weight is 1). One departure, for the bias below: a rollout that comes back to a state counts once in that
state's comparison, by its return from its first visit (with one visit per rollout, the paper's Eq. 7 bit for
bit). The paper's code (verl-agent) also counts each episode's return once per turn in the episode-level mean
and std by default (`compute_mean_std_cross_steps`); here an episode counts once, as its Eq. 3 says.

Why neither `turn` nor `gigpo` has the stopping-time bias of per-turn normalisation (docs/credit.md has the argument
at length): normalising each turn index's rewards among the rollouts that reached it and summing them over the
remaining turns (MT-GRPO, verl#7244) subtracts one baseline per remaining turn, a penalty of about one mean turn
reward per extra turn, decided by the policy's own choice to go on. `turn` computes its baseline b_i and scale s
from whole episodes of the group, once, not per turn index: the number of terms in what is subtracted from G_it
never depends on when episode i stopped. GiGPO's step baseline, as the paper writes it, is the mean over a state's
turns, so a rollout that stays in a state (a refused action leaves the GUI page as it was) adds one term per extra
turn there, decided by its own actions: hence one term per rollout (with rloo, none of its own: then unbiased). With
gamma = 1 and no turn rewards, G_it = R_i and both `turn` and `gigpo` at step_weight 0 give exactly the trajectory
advantages (tests say so bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import fmean

import torch

from agent_rl.core.types import Trajectory
from agent_rl.learn.advantages import ESTIMATORS, GroupAdvantages, GroupCredit, Relative


def turn_returns(rewards_T: Sequence[float], outcome: float, gamma: float, share: float = 1.0) -> list[float]:
    """G_t = c_t + gamma G_t+1, the last turn's being its c plus the outcome, c_t = share r_t (what the episode's return
    counts each turn's reward for, `Return.share`); and where share is not 1, plus what the turns before t were paid
    beyond what they count for, sum_{j<t} gamma^(j-t) (share - 1) r_j, settled at the end: G_t is then the episode's
    discounted value less what the turns before t were paid, seen from t (core.returns). gamma 0: no settling."""
    out: list[float] = []
    g = outcome
    for t in reversed(range(len(rewards_T))):
        r = rewards_T[t] if share == 1.0 else share * rewards_T[t]
        g = r + (g if t == len(rewards_T) - 1 else gamma * g)
        out.append(g)
    out.reverse()
    if share != 1.0 and gamma > 0.0:
        past = 0.0
        for t, r in enumerate(rewards_T):
            out[t] += past
            past = (past + (share - 1.0) * r) / gamma
    return out


@dataclass(frozen=True)
class TurnCredit:
    """Credit per turn as the config sets it: a `learn.advantages.CreditRule` for `group_advantages`."""

    rule: str  # a key of CREDITS whose row has a rule
    estimator: str = "grpo"  # algorithm.advantage: a key of learn.advantages.ESTIMATORS
    gamma: float = 1.0
    step_weight: float = 1.0

    def returns(self, kept: Sequence[Trajectory]) -> list[list[float]]:
        """G_it of each kept rollout, from its turns' rewards and its return's outcome and share."""
        out = []
        for t in kept:
            assert t.ret is not None, f"trajectory of task {t.task_id!r} has no return (core.returns.scored)"
            out.append(turn_returns([turn.reward for turn in t.turns], t.ret.outcome, self.gamma, t.ret.share))
        return out

    def __call__(self, kept: Sequence[Trajectory], advantages_G: torch.Tensor) -> GroupCredit:
        """`kept`: trajectories whose returns are usable (`Trajectory.ret`)."""
        assign = CREDITS[self.rule].assign
        assert assign is not None, f"credit {self.rule!r} gives each token its episode's advantage: no TurnCredit"
        return assign(self, kept, advantages_G)


def turn_credit(credit: TurnCredit, kept: Sequence[Trajectory], advantages_G: torch.Tensor) -> GroupCredit:
    """Each turn's return against the baseline and scale the estimator takes from the group's episode
    returns G_i0 (an episode without a turn: its outcome). All G_i0 equal to c: the baseline is c
    exactly (every estimator's is), and an estimator that scales by their spread (grpo) has nothing to
    scale by: every turn 0."""
    returns = credit.returns(kept)
    first = [g[0] if g else t.ret.value for g, t in zip(returns, kept) if t.ret is not None]
    relative = ESTIMATORS[credit.estimator].relative(torch.tensor(first, dtype=torch.float64))
    if len(set(first)) <= 1:
        if relative.scale is not None:
            return GroupCredit(tuple((0.0,) * len(g) for g in returns))
        relative = Relative(torch.tensor(first[0], dtype=torch.float64))
    # the estimator's own arithmetic, turn by turn: IEEE subtraction and division round alike in Python and torch
    baseline_G = relative.baseline_G.expand(len(kept)).tolist()
    scale = None if relative.scale is None else float(relative.scale)
    out = tuple(tuple(a - b if scale is None else (a - b) / scale for a in g) for g, b in zip(returns, baseline_G))
    return GroupCredit(out)


def step_groups(kept: Sequence[Trajectory]) -> list[list[tuple[int, int]]]:
    """The group's turns as (rollout, turn), gathered by the state they start from (`Turn.state`), in
    order of first appearance; a turn without a known state ("") is a group of its own."""
    by_state: dict[str, list[tuple[int, int]]] = {}
    alone: list[list[tuple[int, int]]] = []
    for i, traj in enumerate(kept):
        for t, turn in enumerate(traj.turns):
            if turn.state:
                by_state.setdefault(turn.state, []).append((i, t))
            else:
                alone.append([(i, t)])
    return [*by_state.values(), *alone]


def step_advantages(values: Sequence[float], owners: Sequence[int], relative: Callable[[torch.Tensor], Relative]
                    ) -> list[float]:
    """GiGPO's step advantages of the turns of one step group (their returns `values`, the rollout of each in
    `owners`), by the estimator's comparison `relative`: each rollout counts once, by its return from the first
    time it started a turn from this state, however often it came back; each turn's return is compared with those.
    0 for all where fewer than two rollouts start from the state, or every return is equal. With one turn per
    rollout this is the estimator over `values` itself, bit for bit (the paper's Eq. 7)."""
    first: dict[int, float] = {}
    for v, o in zip(values, owners):
        first.setdefault(o, v)
    if len(first) < 2 or len(set(values)) <= 1:  # nothing to compare with; equal returns: exactly 0
        return [0.0] * len(values)
    rollouts = list(first)
    rel = relative(torch.tensor(list(first.values()), dtype=torch.float64))
    baseline = dict(zip(rollouts, rel.baseline_G.expand(len(rollouts)).tolist()))
    scale = None if rel.scale is None else float(rel.scale)
    # the estimator's own arithmetic, turn by turn: IEEE subtraction and division round alike in Python and torch
    return [v - baseline[o] if scale is None else (v - baseline[o]) / scale for v, o in zip(values, owners)]


def gigpo_credit(credit: TurnCredit, kept: Sequence[Trajectory], advantages_G: torch.Tensor) -> GroupCredit:
    """GiGPO: the episode's advantage plus step_weight x its step advantage among the turns that start from the same
    state (`step_advantages`; module doc)."""
    returns = credit.returns(kept)
    relative = ESTIMATORS[credit.estimator].relative
    step = [[0.0] * len(g) for g in returns]
    shared = 0
    for members in step_groups(kept):
        owners = [i for i, _ in members]
        if len(set(owners)) > 1:
            shared += len(members)  # turns compared with another rollout's
        for (i, t), a in zip(members, step_advantages([returns[i][t] for i, t in members], owners, relative)):
            step[i][t] = a
    episode = [float(a) for a in advantages_G]
    out = tuple(tuple(episode[i] + credit.step_weight * s for s in step[i]) for i in range(len(kept)))
    return GroupCredit(out, turns_in_step_groups=shared)


@dataclass(frozen=True)
class Credit:
    """One `algorithm.credit`: the rule that gives each turn its advantage, and the settings it reads."""

    # None: no rule, every token gets its episode's advantage (the group bookkeeping alone decides)
    assign: Callable[[TurnCredit, Sequence[Trajectory], torch.Tensor], GroupCredit] | None
    reads: tuple[str, ...] = ()  # the `algorithm` fields the rule reads besides the estimator


CREDITS: dict[str, Credit] = {
    "trajectory": Credit(None),
    "turn": Credit(turn_credit, reads=("gamma",)),
    "gigpo": Credit(gigpo_credit, reads=("gamma", "step_weight")),
}


def credit_metrics(adv: GroupAdvantages, credit: TurnCredit | None) -> dict[str, float]:
    """Per episode, never per turn: the spread of its turns' advantages (max - min), averaged over the
    batch's episodes; with gigpo, the share of the batch's turns that share their start state with another
    rollout's turn (compared in a step group)."""
    if credit is None or adv.turn_advantages is None:
        return {}
    spreads = [max(a) - min(a) for a in adv.turn_advantages if a]
    out = {"advantage_spread_mean": fmean(spreads) if spreads else 0.0}
    if credit.rule == "gigpo":
        turns = sum(len(a) for a in adv.turn_advantages)
        out["step_group_turn_share"] = adv.turns_in_step_groups / turns if turns else 0.0
    return out
