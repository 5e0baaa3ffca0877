"""GiGPO (`credit: gigpo`) against its paper (Feng et al., 2025, "Group-in-Group Policy Optimization for LLM Agent
Training"; code: verl-agent), on groups written by hand: anchor states grouped exactly (Eq. 6), the discounted
step return (Eq. 5), episode and step advantages by the same estimator (Eq. 3, 7) combined as A^E + w A^S (Eq. 8),
each episode counted once at the episode level; and the per-turn normalisation bias (verl#7244's, here through a
rollout that stays in a state) measured on a toy whose policy decides how long to stay, and removed."""

from __future__ import annotations

import math
from statistics import fmean, stdev

import pytest
import torch

from agent_rl.core.returns import scored
from agent_rl.core.types import StopReason, Trajectory, TrajectoryGroup, Turn
from agent_rl.learn.advantages import ESTIMATORS, group_advantages
from agent_rl.learn.credit import TurnCredit, step_advantages, step_groups, turn_returns
from agent_rl.learn.loss import ppo_clip_loss

EPS = 1e-6  # GRPO's: std + 1e-6, as verl-agent's step_norm_reward and episode_norm_reward


def episode(rewards: list[float], outcome: float, states: list[str], name: str) -> Trajectory:
    turns = tuple(Turn(1, 1, "stop", 0, reward=r, state=s) for r, s in zip(rewards, states))
    return Trajectory(name, (), (), (), 0, turns, (), (), StopReason.NO_TOOL_CALL, reward=outcome)


def gigpo(group: list[Trajectory], estimator: str, **settings) -> tuple[list[float], list[list[float]]]:
    adv = group_advantages([TrajectoryGroup("q", scored(group))], ESTIMATORS[estimator].advantages,
                           TurnCredit("gigpo", estimator, **settings))
    assert [t.task_id for t in adv.trajectories] == [t.task_id for t in group]
    return list(adv.advantages), [list(a) for a in adv.turn_advantages]


def close(actual, expected, tol: float = 1e-12) -> None:
    assert len(actual) == len(expected), (actual, expected)
    for a, e in zip(actual, expected):
        assert len(a) == len(e) and all(abs(x - y) <= tol for x, y in zip(a, e)), (actual, expected)


def test_anchor_states_are_grouped_exactly():
    # equal keys across rollouts and turn indices; keys that differ by a character or a space are other states;
    # a rollout back in a state it left is in its group again; a turn without a known state is alone
    a = episode([0.0] * 3, 1.0, ["page:0", "page:1", "page:0"], "a")
    b = episode([0.0] * 2, 0.0, ["page:0", "page:1 "], "b")
    c = episode([0.0] * 2, 0.0, ["Page:0", ""], "c")
    assert step_groups([a, b, c]) == [[(0, 0), (0, 2), (1, 0)], [(0, 1)], [(1, 1)], [(2, 0)], [(2, 1)]]


def test_the_step_return_is_the_papers_discounted_sum():
    # Eq. 5: R_t = sum_{k >= t} gamma^(k - t) r_k, the outcome being the last step's reward
    rewards, outcome, gamma = [0.5, -0.1, 0.0, 0.2], 1.0, 0.95
    by_hand = [sum(gamma ** (k - t) * (r + (outcome if k == 3 else 0.0)) for k, r in enumerate(rewards) if k >= t)
               for t in range(4)]
    assert turn_returns(rewards, outcome, gamma) == pytest.approx(by_hand, abs=1e-15)
    # by hand: R_3 = 1.2, R_2 = 0.95 x 1.2 = 1.14, R_1 = -0.1 + 1.083 = 0.983, R_0 = 0.5 + 0.93385 = 1.43385
    assert by_hand == pytest.approx([1.43385, 0.983, 1.14, 1.2], abs=1e-12)


def test_the_combined_advantage_is_the_papers_formula_by_hand():
    """Three rollouts of one task, gamma 0.95 (the paper's), grpo at both levels (F_norm = std), w = 1 (the paper's).
    a: s0 -> s1 -> s2, a refused action at s1 (-0.1), solved; b: s0 -> s1, solved; c: s0 -> s3, failed."""
    a = episode([0.0, -0.1, 0.0], 1.0, ["s0", "s1", "s2"], "a")
    b = episode([0.0, 0.0], 1.0, ["s0", "s1"], "b")
    c = episode([0.0, 0.0], 0.0, ["s0", "s3"], "c")
    episode_adv, turns = gigpo([a, b, c], "grpo", gamma=0.95, step_weight=1.0)
    # Eq. 3: R(tau) = sum_t r_t, undiscounted: 0.9, 1.0, 0.0; (R - mean) / (std + eps)
    totals = [0.9, 1.0, 0.0]
    a_e = [(r - fmean(totals)) / (stdev(totals) + EPS) for r in totals]
    assert episode_adv == pytest.approx(a_e, abs=1e-12)
    assert a_e == pytest.approx([0.26667 / 0.550757, 0.36667 / 0.550757, -0.63333 / 0.550757], abs=1e-4)
    # Eq. 5 with gamma 0.95: a 0.8075, 0.85, 1.0; b 0.95, 1.0; c 0.0, 0.0
    g = {("a", 0): 0.95 * (-0.1 + 0.95 * 1.0), ("a", 1): -0.1 + 0.95 * 1.0, ("a", 2): 1.0,
         ("b", 0): 0.95 * 1.0, ("b", 1): 1.0, ("c", 0): 0.0, ("c", 1): 0.0}
    # Eq. 6: s0 = {a0, b0, c0}, s1 = {a1, b1}; s2, s3 alone (Eq. 7 gives them 0)
    s0, s1 = [g["a", 0], g["b", 0], g["c", 0]], [g["a", 1], g["b", 1]]

    def a_s(v, members):  # Eq. 7
        return (v - fmean(members)) / (stdev(members) + EPS)

    # Eq. 8: A = A^E + w A^S, w = 1
    close(turns, [[a_e[0] + a_s(g["a", 0], s0), a_e[0] + a_s(g["a", 1], s1), a_e[0]],
                  [a_e[1] + a_s(g["b", 0], s0), a_e[1] + a_s(g["b", 1], s1)],
                  [a_e[2] + a_s(g["c", 0], s0), a_e[2]]])
    # s1 by hand: returns 0.85 and 1.0, mean 0.925, std 0.106066: -0.7071 and +0.7071
    assert a_s(g["a", 1], s1) == pytest.approx(-0.075 / (0.075 * math.sqrt(2) + EPS), abs=1e-12)
    # the weight scales the step part only (w = 0.5)
    _, half = gigpo([a, b, c], "grpo", gamma=0.95, step_weight=0.5)
    assert half[1][1] == pytest.approx(a_e[1] + 0.5 * a_s(g["b", 1], s1), abs=1e-12)


def test_each_episode_counts_once_at_the_episode_level():
    """verl-agent's default (`compute_mean_std_cross_steps`) takes the episode-level mean over the group's steps, so
    an episode of three turns counts three times; Eq. 3, and this code, once: the turn counts change nothing."""
    a = episode([-0.1, 0.0, 0.0], 1.0, ["s0", "s0", "s1"], "a")  # value 0.9 over three turns
    b = episode([0.0, 0.0], 1.0, ["s0", "s1"], "b")
    c = episode([0.0], 0.0, ["s0"], "c")
    episode_adv, _ = gigpo([a, b, c], "dr_grpo")
    assert episode_adv == [0.9 - 1.9 / 3, 1.0 - 1.9 / 3, 0.0 - 1.9 / 3]
    per_step_mean = (3 * 0.9 + 2 * 1.0 + 1 * 0.0) / 6  # 0.7833: what counting each turn would subtract
    assert abs(per_step_mean - 1.9 / 3) > 0.1


def test_a_rollout_counts_once_in_a_states_comparison():
    """a: a refused action leaves the page as it was, so a starts twice from s0. In s0's comparison a counts once, by
    its return from its first visit, as b and c do by theirs; each turn's return is compared with those. dr_grpo,
    w = 1, gamma 1."""
    a = episode([-0.1, 0.0, 0.0], 1.0, ["s0", "s0", "s1"], "a")  # G: 0.9, 1.0, 1.0
    b = episode([0.0, 0.0], 1.0, ["s0", "s1"], "b")  # G: 1.0, 1.0
    c = episode([0.0], 0.0, ["s0"], "c")  # G: 0.0
    # s0: a 0.9, b 1.0, c 0.0: baseline 1.9 / 3 (as written, the paper's mean of the four returns would be 0.725,
    # a's second turn there adding a term)
    relative = ESTIMATORS["dr_grpo"].relative
    assert step_advantages([0.9, 1.0, 1.0, 0.0], [0, 0, 1, 2], relative) == pytest.approx(
        [0.9 - 1.9 / 3, 1.0 - 1.9 / 3, 1.0 - 1.9 / 3, -1.9 / 3], abs=1e-12)
    episode_adv, turns = gigpo([a, b, c], "dr_grpo")
    e = [0.9 - 1.9 / 3, 1.0 - 1.9 / 3, -1.9 / 3]
    assert episode_adv == pytest.approx(e, abs=1e-12)
    close(turns, [[e[0] + 0.9 - 1.9 / 3, e[0] + 1.0 - 1.9 / 3, e[0]],  # s1: 1.0 and 1.0, equal: 0
                  [e[1] + 1.0 - 1.9 / 3, e[1]], [e[2] - 1.9 / 3]])
    # rloo: each rollout against the others': a's turns against (1.0 + 0) / 2, b's (0.9 + 0) / 2, c's 0.95
    assert step_advantages([0.9, 1.0, 1.0, 0.0], [0, 0, 1, 2], ESTIMATORS["rloo"].relative) == pytest.approx(
        [0.4, 0.5, 0.55, -0.95], abs=1e-12)
    # with one turn per rollout the comparison is the estimator over the whole step group, bit for bit
    values = [0.3, 1.0, 0.0, 0.7]
    for estimator in ESTIMATORS.values():
        assert step_advantages(values, [0, 1, 2, 3], estimator.relative) == \
            [float(x) for x in estimator.advantages(torch.tensor(values, dtype=torch.float64))]
    assert step_advantages([0.5, 0.5], [0, 1], ESTIMATORS["grpo"].relative) == [0.0, 0.0]  # equal returns: 0
    assert step_advantages([0.5, 0.7], [0, 0], ESTIMATORS["grpo"].relative) == [0.0, 0.0]  # one rollout: 0


# -- the bias, on a toy whose policy decides how long to stay in its start state ---------------------------------
TURNS, WAIT, THETA, GROUP, N = 3, -0.1, -1.0, 4, 1500


def toy_exact_gradient() -> float:
    """Each turn the policy acts (p = sigmoid(theta)): solved, value 1 + 0.1 per earlier wait spent (-0.1 each: a
    success pays its penalties); or waits, staying in the start state. Never acting in three turns: failed, 0."""
    theta = torch.tensor(THETA, requires_grad=True)
    p = torch.sigmoid(theta)
    value = sum((1 - p) ** k * p * (1 + k * WAIT) for k in range(TURNS))
    return torch.autograd.grad(value, theta)[0].item()


def toy_groups() -> list[TrajectoryGroup]:
    u = torch.rand((N, GROUP, TURNS), generator=torch.Generator().manual_seed(0))
    acts = (u < torch.sigmoid(torch.tensor(THETA))).tolist()
    groups = []
    for g in range(N):
        trajs = []
        for i in range(GROUP):
            k = next((t for t in range(TURNS) if acts[g][i][t]), TURNS)  # waits before acting
            rewards = [WAIT] * min(k, TURNS) + ([0.0] if k < TURNS else [])
            trajs.append(episode(rewards, 1.0 if k < TURNS else 0.0, ["start"] * len(rewards), f"{g}.{i}"))
        groups.append(TrajectoryGroup(f"q{g}", scored(trajs)))
    return groups


def toy_gradient(groups: list[TrajectoryGroup], turn_advantages: list[list[float]]) -> tuple[float, float]:
    """The mean over episodes of minus the PPO loss's gradient at ratio 1 (one token a turn), and its standard error."""
    trajs = [t for g in groups for t in g.trajectories]
    B = len(trajs)
    acted_B_T = torch.zeros(B, TURNS, dtype=torch.bool)
    mask_B_T = torch.zeros(B, TURNS, dtype=torch.bool)
    advantage_B_T = torch.zeros(B, TURNS)
    for b, (t, adv) in enumerate(zip(trajs, turn_advantages)):
        for k, a in enumerate(adv):
            mask_B_T[b, k], advantage_B_T[b, k] = True, a
        acted_B_T[b, len(t.turns) - 1] = t.reward == 1.0
    theta = torch.tensor(THETA, requires_grad=True)
    logsig = torch.nn.functional.logsigmoid
    logp_B_T = torch.where(acted_B_T, logsig(theta), logsig(-theta)).expand(B, TURNS)
    loss_B_T = ppo_clip_loss(logp_B_T, logp_B_T.detach(), advantage_B_T, mask_B_T).loss_B_T
    grad = -torch.autograd.grad(loss_B_T.sum() / B, theta)[0].item()
    p = torch.sigmoid(torch.tensor(THETA))
    share_B = (advantage_B_T * torch.where(acted_B_T, 1 - p, -p) * mask_B_T).sum(1)
    return grad, (share_B.std() / math.sqrt(B)).item()


def test_gigpo_follows_the_policy_gradient_and_counting_a_rollouts_every_visit_does_not():
    """6,000 seeded episodes, rloo at both levels, w = 1: the expected update is (1 + w) x the exact gradient,
    0.6012. Shipped (each rollout once in a state's comparison, rloo: against the other rollouts' first returns
    there): within 4
    standard errors (0.005 each). The paper's step groups as written (every turn in, rloo: against the state's other
    turns): 0.562, over 6 standard errors short. Its baseline has a term for each turn a rollout stayed, a number
    the rollout's own waiting decides (verl#7244's bias, here through anchor states)."""
    # by hand: p = sigmoid(-1) = 0.26894, J = p (1 + 0.9 (1 - p) + 0.8 (1 - p)^2), dJ/dp = 1 + 0.9 (1 - 2p)
    # + 0.8 ((1 - p)^2 - 2p (1 - p)) = 1.52889, dp/dtheta = p (1 - p) = 0.19661: dJ/dtheta = 0.30059
    target = 2 * toy_exact_gradient()
    assert target == pytest.approx(2 * 0.30059, abs=1e-4)
    groups = toy_groups()
    adv = group_advantages(groups, ESTIMATORS["rloo"].advantages, TurnCredit("gigpo", "rloo"))
    kept = {id(t): list(a) for t, a in zip(adv.trajectories, adv.turn_advantages)}
    shipped = [kept.get(id(t), [0.0] * len(t.turns)) for g in groups for t in g.trajectories]
    grad, se = toy_gradient(groups, shipped)
    assert abs(grad - target) <= 4 * se, (grad, target, se)
    paper = []
    for g in groups:  # every turn is in the one state: rloo over all the group's turns, as Eq. 7 with G^S(start)
        values = [v for t in g.trajectories
                  for v in turn_returns([x.reward for x in t.turns], t.ret.outcome, 1.0, t.ret.share)]
        step = ESTIMATORS["rloo"].advantages(torch.tensor(values, dtype=torch.float64)).tolist()
        episode_adv = ESTIMATORS["rloo"].advantages(torch.tensor([t.ret.value for t in g.trajectories])).tolist()
        for i, t in enumerate(g.trajectories):
            paper.append([episode_adv[i] + step.pop(0) for _ in t.turns])
    paper_grad, paper_se = toy_gradient(groups, paper)
    assert target - paper_grad > 6 * paper_se and target - paper_grad > 0.03, (paper_grad, target, paper_se)
