"""Credit per turn (`learn.credit`), against numbers worked out by hand: each turn's return, `turn` and
`gigpo` advantages on crafted groups (variable turn counts, turn rewards, truncation, shared states);
outcome-only rewards at gamma 1 (`turn`) and step_weight 0 (`gigpo`) give the trajectory advantages
exactly; and on a toy environment whose policy decides when to stop, the shipped estimator's mean
gradient matches the exact policy gradient while per-turn-index normalisation (MT-GRPO, verl#7244)
misses it."""

from __future__ import annotations

import math
import random

import pytest
import torch
from helpers import scored_groups, trajectory

from agent_rl.core.returns import episode_return
from agent_rl.core.types import StopReason, Trajectory, TrajectoryGroup, Turn
from agent_rl.learn.advantages import (
    ESTIMATORS,
    compare,
    dr_grpo_advantages,
    group_advantages,
    grpo_advantages,
    rloo_advantages,
)
from agent_rl.learn.credit import TurnCredit, credit_metrics, step_groups, turn_returns
from agent_rl.learn.loss import ppo_clip_loss


def traj(rewards: list[float], outcome: float, stop: StopReason = StopReason.NO_TOOL_CALL,
         states: list[str] | None = None, name: str = "t") -> Trajectory:
    """An episode of len(rewards) turns (no tokens: advantages read rewards, turns and states only); a truncated
    one's last turn is the one its token limit cut."""
    states = states or [""] * len(rewards)
    cut = ["stop"] * len(rewards)
    if stop in (StopReason.LENGTH, StopReason.MAX_TOKENS) and cut:
        cut[-1] = "length"
    turns = tuple(Turn(1, 1, f, 0, reward=r, state=s) for r, s, f in zip(rewards, states, cut))
    return Trajectory(name, (), (), (), 0, turns, (), (), stop, reward=outcome)


def close(actual, expected, tol: float = 1e-12):
    assert len(actual) == len(expected), (actual, expected)
    for a, e in zip(actual, expected):
        assert len(a) == len(e) and all(abs(x - y) <= tol for x, y in zip(a, e)), (actual, expected)


def test_turn_returns_by_hand():
    # G2 = 0 + 1 = 1; G1 = -0.1 + 0.5 x 1 = 0.4; G0 = 0.1 + 0.5 x 0.4 = 0.3
    assert turn_returns([0.1, -0.1, 0.0], 1.0, 0.5) == pytest.approx([0.3, 0.4, 1.0], abs=1e-15)
    # gamma 1, no turn rewards: every turn's return is the outcome, exactly
    assert turn_returns([0.0, 0.0, 0.0], 0.7, 1.0) == [0.7, 0.7, 0.7]
    assert turn_returns([], 1.0, 0.9) == []
    # a failure (share 0): its turns count nothing, what they were paid is settled at its end; seen from turn t,
    # (value - sum_{j<t} gamma^j r_j) / gamma^t: 0, (0 + 0.1) / 0.5 = 0.2, (0 + 0.1 + 0.5 x 0.2) / 0.25 = 0.8
    assert turn_returns([-0.1, -0.2, 0.0], 0.0, 0.5, share=0.0) == pytest.approx([0.0, 0.2, 0.8], abs=1e-15)
    # a graded outcome 0.5 (share 0.5), gamma 1: the value 0.4; turn 1: 0.4 less turn 0's -0.2 = 0.6
    assert turn_returns([-0.2, 0.0], 0.5, 1.0, share=0.5) == pytest.approx([0.4, 0.6], abs=1e-15)
    assert turn_returns([-0.2, 0.3], 0.0, 0.0, share=0.0) == [0.0, 0.0]  # gamma 0: each turn its own, nothing settled


# a crafted group: 3, 1, 2 and 2 turns; turn rewards; C truncated (its outcome: truncated_reward 0.0, the lowest of
# the others' values too, plus its cut turn, a failed call, -0.1; its turns count nothing, so what they were paid,
# -0.4, is settled at its end); E an infrastructure error, kept out
A = traj([0.0, -0.1, 0.0], 1.0, name="A")
B = traj([0.0], 0.0, name="B")
C = traj([-0.3, -0.1], 0.7, StopReason.LENGTH, name="C")
D = traj([0.0, 0.0], 1.0, name="D")
E = traj([0.0], 1.0, StopReason.ERROR, name="E")
CRAFTED = [TrajectoryGroup("q", (A, B, C, D, E))]


def test_turn_credit_by_hand_gamma_one():
    # returns G: A [0.9, 0.9, 1.0], B [0.0], C [-0.1, 0.2], D [1.0, 1.0]; G_0 mean = 1.8 / 4 = 0.45
    adv = group_advantages(scored_groups(CRAFTED, 0.0), dr_grpo_advantages, TurnCredit("turn", "dr_grpo"))
    assert [t.task_id for t in adv.trajectories] == ["A", "B", "C", "D"]
    close(adv.turn_advantages, [[0.45, 0.45, 0.55], [-0.45], [-0.55, -0.25], [0.55, 0.55]])
    # the episode advantages: episode returns (outcome + turn rewards) 0.9, 0, -0.1, 1 minus their mean
    assert adv.advantages == pytest.approx([0.45, -0.45, -0.55, 0.55], abs=1e-12)
    # grpo: the same differences over the sample std of G_0: deviations +-0.45, +-0.55, squares 1.01, / 3
    s = math.sqrt(1.01 / 3) + 1e-6
    grpo = group_advantages(scored_groups(CRAFTED, 0.0), grpo_advantages, TurnCredit("turn", "grpo"))
    close(grpo.turn_advantages, [[0.45 / s, 0.45 / s, 0.55 / s], [-0.45 / s], [-0.55 / s, -0.25 / s],
                                 [0.55 / s, 0.55 / s]])
    # rloo: against the mean of the others' G_0: A 0.9 - (0 - 0.1 + 1) / 3 = 0.6, 1.0 - 0.3 = 0.7
    rloo = group_advantages(scored_groups(CRAFTED, 0.0), rloo_advantages, TurnCredit("turn", "rloo"))
    close(rloo.turn_advantages, [[0.6, 0.6, 0.7], [0.0 - 1.8 / 3], [-0.1 - 1.9 / 3, 0.2 - 1.9 / 3],
                                 [1.0 - 0.8 / 3, 1.0 - 0.8 / 3]])


def test_turn_credit_by_hand_with_discount_and_truncation():
    # gamma 0.5: A: G2 = 1, G1 = -0.1 + 0.5 = 0.4, G0 = 0.2; B: 0; C (its turns count nothing, its outcome -0.1):
    # G0 = 0.5 x -0.1 = -0.05, its value; G1 = -0.1 + 0.3 / 0.5 = 0.5, the value less turn 0's -0.3, seen from turn 1
    # (-0.05 + 0.3) / 0.5; D: G1 = 1, G0 = 0.5. G_0 mean = (0.2 + 0 - 0.05 + 0.5) / 4 = 0.1625
    adv = group_advantages(scored_groups(CRAFTED, 0.0), dr_grpo_advantages,
                           TurnCredit("turn", "dr_grpo", gamma=0.5))
    close(adv.turn_advantages, [[0.0375, 0.2375, 0.8375], [-0.1625], [-0.2125, 0.3375], [0.3375, 0.8375]])
    # truncated episodes masked out (truncated_reward None): A, B, D; G_0 mean (0.9 + 0 + 1) / 3
    masked = group_advantages(scored_groups(CRAFTED), dr_grpo_advantages, TurnCredit("turn", "dr_grpo"))
    m = 1.9 / 3
    assert [t.task_id for t in masked.trajectories] == ["A", "B", "D"]
    close(masked.turn_advantages, [[0.9 - m, 0.9 - m, 1.0 - m], [-m], [1.0 - m, 1.0 - m]])


def test_a_group_of_equal_returns_stays_when_its_turns_differ():
    # returns 0.9 and 0.9 (one penalty each, at different turns): trajectory credit has nothing to compare
    group = [TrajectoryGroup("q", (trajectory(1.0, turns=[-0.1, 0.0]), trajectory(1.0, turns=[0.0, -0.1])))]
    assert group_advantages(scored_groups(group), dr_grpo_advantages).num_zero_variance_groups == 1
    # dr_grpo per turn: G = [0.9, 1.0] and [0.9, 0.9] against c = 0.9: the turn after the penalty did better
    adv = group_advantages(scored_groups(group), dr_grpo_advantages, TurnCredit("turn", "dr_grpo"))
    assert adv.num_zero_variance_groups == 0 and adv.advantages == (0.0, 0.0)
    close(adv.turn_advantages, [[0.0, 0.1], [0.0, 0.0]])
    # grpo scales by the spread of G_0, which is 0: nothing to scale by, so no signal
    adv = group_advantages(scored_groups(group), grpo_advantages, TurnCredit("turn", "grpo"))
    assert adv.num_zero_variance_groups == 1


def test_gigpo_step_groups_and_advantages_by_hand():
    a = traj([0.0, 0.0, 0.0], 1.0, states=["s0", "s1", "s2"], name="a")
    b = traj([0.0, -0.1, 0.0], 1.0, states=["s0", "s1", "s3"], name="b")
    c = traj([0.0, 0.0], 0.0, states=["s0", "s4"], name="c")
    d = traj([0.0], 0.0, states=[""], name="d")  # no known state: never grouped
    assert step_groups([a, b, c, d]) == [[(0, 0), (1, 0), (2, 0)], [(0, 1), (1, 1)], [(0, 2)], [(1, 2)], [(2, 1)],
                                         [(3, 0)]]
    group = [TrajectoryGroup("q", (a, b, c, d))]
    adv = group_advantages(scored_groups(group), dr_grpo_advantages,
                           TurnCredit("gigpo", "dr_grpo", step_weight=0.5))
    # episode returns 1, 0.9, 0, 0: mean 0.475 -> episode advantages 0.525, 0.425, -0.475, -0.475
    # G: a [1, 1, 1], b [0.9, 0.9, 1], c [0, 0]. s0: 1, 0.9, 0 (mean 1.9 / 3) -> 1.1 / 3, 0.8 / 3, -1.9 / 3;
    # s1: 1, 0.9 (mean 0.95) -> 0.05, -0.05; the others alone: 0
    close(adv.turn_advantages, [[0.525 + 0.55 / 3, 0.525 + 0.025, 0.525], [0.425 + 0.4 / 3, 0.425 - 0.025, 0.425],
                                [-0.475 - 0.95 / 3, -0.475], [-0.475]])
    assert adv.turns_in_step_groups == 5
    metrics = credit_metrics(adv, TurnCredit("gigpo", "dr_grpo", step_weight=0.5))
    # 5 of the 9 turns share a state; spreads (max - min) per episode: 0.55 / 3, 0.4 / 3 + 0.025, 0.95 / 3, 0
    # -> mean (1.9 / 3 + 0.025) / 4
    assert metrics == pytest.approx({"step_group_turn_share": 5 / 9, "advantage_spread_mean": (1.9 / 3 + 0.025) / 4},
                                    abs=1e-12)


def test_gigpo_with_equal_returns_in_a_state_gives_exactly_zero_there():
    # three returns of 0.1 from s0: their float mean is 0.10000000000000002, so grpo would give each
    # -2e-17 / 1e-6 = -2e-11; equal returns tell nothing apart, so 0.0 exactly and the group is dropped
    trajs = tuple(trajectory(0.0, turns=[0.0, 0.1], states=["s0", f"s{k}"]) for k in (1, 2, 3))
    assert sum([0.1, 0.1, 0.1]) / 3 != 0.1
    adv = group_advantages(scored_groups([TrajectoryGroup("q", trajs)]), grpo_advantages,
                           TurnCredit("gigpo", "grpo"))
    assert adv.num_zero_variance_groups == 1 and adv.turn_advantages == ()


# -- outcome-only rewards: exactly the trajectory advantages ------------------------------------------------
def random_groups(seed: int, n: int = 40) -> list[TrajectoryGroup]:
    rng = random.Random(seed)
    stops = [StopReason.NO_TOOL_CALL, StopReason.MAX_TURNS, StopReason.LENGTH, StopReason.ERROR]
    groups = []
    for g in range(n):
        trajs = []
        for i in range(rng.choice([2, 4, 5])):
            turns = rng.randint(0, 4)
            trajs.append(trajectory(rng.choice([0.0, 0.3, 1.0, 1 / 3]), rng.choice(stops), turns=[0.0] * turns,
                                    states=[rng.choice("xyz") for _ in range(turns)], task_id=f"g{g}r{i}"))
        groups.append(TrajectoryGroup(f"g{g}", tuple(trajs)))
    return groups


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
@pytest.mark.parametrize("truncated_reward", [None, 0.0])
def test_outcome_only_turn_and_gigpo_at_zero_weight_are_the_trajectory_advantages(estimator, truncated_reward):
    groups = random_groups(7)
    fn = ESTIMATORS[estimator][0]
    groups = scored_groups(groups, truncated_reward)
    plain = group_advantages(groups, fn)
    assert plain.turn_advantages is None and len(plain.trajectories) > 30
    for credit in (TurnCredit("turn", estimator), TurnCredit("gigpo", estimator, step_weight=0.0)):
        adv = group_advantages(groups, fn, credit)
        assert adv.trajectories == plain.trajectories and adv.advantages == plain.advantages
        assert adv.num_zero_variance_groups == plain.num_zero_variance_groups
        assert adv.turn_advantages == tuple((a,) * len(t.turns) for t, a in zip(plain.trajectories, plain.advantages))


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_each_estimator_is_its_comparison(estimator):
    fn, relative = ESTIMATORS[estimator]
    for rewards in ([1.0, 0.0, 0.0, 1.0], [0.3, 0.1, 0.7], [1 / 3, 2 / 3, 0.1, 0.9, 0.5]):
        r = torch.tensor(rewards, dtype=torch.float64)
        assert torch.equal(fn(r), compare(r, relative(r)))


# -- unbiasedness on a toy environment whose policy decides when to stop -------------------------------------
CALL_REWARD, MAX_TURNS, GROUP = 0.3, 3, 4
THETA = torch.tensor([0.5, 0.0, -0.5])  # the logit of "call a tool" at turns 0, 1, 2


def toy_episode(calls: list[int]) -> tuple[list[float], float]:
    """Each turn calls a tool (reward +0.3, a useful lookup) or answers; the answer is right (outcome 1) only
    after exactly two calls. The optimal policy is call, call, answer (return 1.6); a third call runs into
    the turn limit unanswered."""
    return [CALL_REWARD if c else 0.0 for c in calls], 1.0 if calls == [1, 1, 0] else 0.0


def exact_gradient() -> torch.Tensor:
    """dJ/dtheta, J = E[the episode's return], summed over the four possible episodes: the outcome plus the turn
    rewards as shares of it (core.returns): 1.6 for call, call, answer, 0 for the three failures."""
    theta = THETA.clone().requires_grad_(True)
    J = torch.zeros(())
    for calls, value in (([0], 0.0), ([1, 0], 0.0), ([1, 1, 0], 1.6), ([1, 1, 1], 0.0)):
        logp = sum(torch.nn.functional.logsigmoid(theta[t] if c else -theta[t]) for t, c in enumerate(calls))
        assert episode_return(traj(*toy_episode(calls))).value == pytest.approx(value, abs=1e-12)
        J = J + torch.exp(logp) * value
    return torch.autograd.grad(J, theta)[0]


def toy_groups(n: int, seed: int) -> tuple[list[TrajectoryGroup], list[list[int]]]:
    """n groups of GROUP episodes under sigmoid(THETA), seeded; and each episode's calls, in order."""
    u = torch.rand((n, GROUP, MAX_TURNS), generator=torch.Generator().manual_seed(seed))
    call = (u < torch.sigmoid(THETA)).tolist()
    groups, episodes = [], []
    for g in range(n):
        trajs = []
        for i in range(GROUP):
            calls = []
            for t in range(MAX_TURNS):
                calls.append(int(call[g][i][t]))
                if not call[g][i][t]:
                    break
            rewards, outcome = toy_episode(calls)
            trajs.append(trajectory(outcome, turns=rewards))
            episodes.append(calls)
        groups.append(TrajectoryGroup(f"q{g}", tuple(trajs)))
    return groups, episodes


def end(t: Trajectory) -> float:
    """What a return pays at its episode's end beyond its turns' rewards as given."""
    return t.ret.value - sum(turn.reward for turn in t.turns)


def per_index_advantages(groups: list[TrajectoryGroup]) -> list[list[float]]:
    """MT-GRPO-style: each turn index's reward against the mean reward at that index among the group's other
    rollouts that reached it (leave-one-out, so only the stopping-time effect is left), summed over the
    rollout's remaining turns, plus the outcome against the others' mean outcome."""
    out = []
    for group in groups:
        for i, t in enumerate(group.trajectories):
            others = [o for j, o in enumerate(group.trajectories) if j != i]
            advantage = []
            for start in range(len(t.turns)):  # each return's value paid as its turns' rewards, the rest at its end
                a = end(t) - sum(end(o) for o in others) / len(others)
                for k in range(start, len(t.turns)):
                    reached = [o.turns[k].reward for o in others if len(o.turns) > k]
                    a += t.turns[k].reward - (sum(reached) / len(reached) if reached else 0.0)
                advantage.append(a)
            out.append(advantage)
    return out


def policy_gradient(episodes: list[list[int]], advantages: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean over episodes of minus the PPO loss's gradient at ratio 1 with these advantages per token (one
    token a turn): sum_t A_t d log pi(a_t | t) / d theta; and its standard error (theta_t enters turn t only,
    so an episode's share of component t is A_t (1 - pi) for a call, A_t (-pi) for an answer)."""
    B = len(episodes)
    advantage_B_T = torch.zeros(B, MAX_TURNS)
    called_B_T = torch.zeros(B, MAX_TURNS, dtype=torch.bool)
    mask_B_T = torch.zeros(B, MAX_TURNS, dtype=torch.bool)
    for b, (calls, adv) in enumerate(zip(episodes, advantages)):
        for t, (c, a) in enumerate(zip(calls, adv)):
            advantage_B_T[b, t], called_B_T[b, t], mask_B_T[b, t] = a, bool(c), True
    theta = THETA.clone().requires_grad_(True)
    logsig = torch.nn.functional.logsigmoid
    logp_B_T = torch.where(called_B_T, logsig(theta).expand(B, -1), logsig(-theta).expand(B, -1))
    loss_B_T = ppo_clip_loss(logp_B_T, logp_B_T.detach(), advantage_B_T, mask_B_T).loss_B_T
    grad = -torch.autograd.grad(loss_B_T.sum() / B, theta)[0]
    pi = torch.sigmoid(THETA)
    share_B_T = advantage_B_T * torch.where(called_B_T, 1 - pi, -pi) * mask_B_T
    return grad, share_B_T.std(0) / math.sqrt(B)


def test_turn_credit_follows_the_policy_gradient_and_per_index_normalisation_does_not():
    """12,000 seeded episodes. The shipped estimator (`turn`, rloo: a baseline from the other rollouts'
    whole episodes, the rules' part of the value paid at the end) is unbiased: its mean gradient is within 4
    standard errors (about 0.01) of the exact one on every parameter. Per-turn-index normalisation is off by
    some 0.04 on the first turn's decision to call (more than 10 standard errors): its baseline has one term per
    remaining turn, so going on costs about one mean turn reward, and it under-rates the calls the optimal policy
    makes."""
    exact = exact_gradient()  # by hand: J = 1.6 p0 p1 (1 - p2) = 0.310, dJ = J (1 - p0, 1 - p1, -p2)
    groups, episodes = toy_groups(3000, seed=0)
    groups = scored_groups(groups)
    adv = group_advantages(groups, rloo_advantages, TurnCredit("turn", "rloo"))
    shipped = {id(t): a for t, a in zip(adv.trajectories, adv.turn_advantages)}  # dropped groups: all 0
    flat = [t for g in groups for t in g.trajectories]
    ours = [list(shipped.get(id(t), [0.0] * len(t.turns))) for t in flat]
    grad, se = policy_gradient(episodes, ours)
    assert torch.all((grad - exact).abs() <= 4 * se), (grad, exact, se)
    index_grad, index_se = policy_gradient(episodes, per_index_advantages(groups))
    assert exact[0] - index_grad[0] > 10 * index_se[0] and exact[0] - index_grad[0] > 0.03, (index_grad, exact)
