"""Advantages per token through batching, the loss and the update: each turn's advantage on its own tokens
(segments included), kept by every split of a batch; the PPO loss and every aggregation with them, by hand;
GSPO refuses them; and outcome-only rewards give the trajectory update exactly (statistics and weights, bit
for bit) with `credit: turn` at gamma 1 and `gigpo` at step_weight 0."""

from __future__ import annotations

import pytest
import torch
from helpers import scored_groups, trajectory

from agent_rl.config.file import load_config
from agent_rl.core.types import Segment, Trajectory, TrajectoryGroup, Turn
from agent_rl.learn.advantages import group_advantages, grpo_advantages
from agent_rl.learn.algorithm import credit_of
from agent_rl.learn.batching import collate, micro_batches, select_rows, split_steps
from agent_rl.learn.logprobs import token_logprobs
from agent_rl.learn.loss import gspo_loss, per_token, ppo_clip_loss, sequence_mean, token_mean
from agent_rl.learn.policy import build_policy, trainable_parameters
from agent_rl.learn.update import policy_update


def two_segment_trajectory() -> Trajectory:
    """Segment 0: ids 1..5, turn 0 sampled at [2, 4); the current segment: ids 10..16, turn 1 at [3, 5) and
    turn 2 at [6, 7)."""
    seg = Segment((1, 2, 3, 4, 5), (0, 0, 1, 1, 0), (0.0, 0.0, -0.5, -0.5, 0.0))
    turns = (Turn(2, 4, "stop", 0, segment=0), Turn(3, 5, "stop", 0, segment=1), Turn(6, 7, "stop", 0, segment=1))
    return trajectory(task_id="two", ids=(10, 11, 12, 13, 14, 15, 16), prompt_len=3, mask=(0, 0, 0, 1, 1, 0, 1),
                      turns=turns, segments=(seg,))


def one_turn_trajectory() -> Trajectory:
    return trajectory(task_id="one", ids=(20, 21, 22, 23), turns=[Turn(1, 4, "stop", 0)])


def test_each_turns_advantage_lands_on_its_own_tokens():
    batch = collate([two_segment_trajectory(), one_turn_trajectory()], [9.0, 7.0],
                    turn_advantages=[(0.5, -1.0, 2.0), (3.0,)])
    # column t holds token t + 1's turn: segment 0's tokens 2, 3 -> columns 1, 2; the current segment's
    # tokens 3, 4 -> columns 2, 3 and token 6 -> column 5; the second trajectory's tokens 1-3 -> columns 0-2
    expected = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0],
                             [0.0, 0.0, -1.0, -1.0, 0.0, 2.0, 0.0],
                             [3.0, 3.0, 3.0, 0.0, 0.0, 0.0, 0.0]])
    assert torch.equal(batch.advantage_B_T, expected)
    assert torch.equal(batch.advantage_B_T != 0, batch.loss_mask_B_T)  # exactly the sampled tokens
    assert torch.equal(batch.advantage_B, torch.tensor([9.0, 9.0, 7.0])) and batch.advantage is batch.advantage_B_T
    # every split keeps each row's advantages: a selection, the mini-batches of steps, micro-batches
    assert torch.equal(select_rows(batch, [2, 0]).advantage_B_T, expected[[2, 0], :5])  # trimmed to 5 tokens
    for part in [*split_steps(batch, 2), *micro_batches(batch, max_tokens=8), *micro_batches(batch, 16, None, True)]:
        assert torch.equal(part.advantage_B_T, expected[part.index_B, : part.input_ids_B_T.shape[1]])
    plain = collate([two_segment_trajectory(), one_turn_trajectory()], [9.0, 7.0])
    assert plain.advantage_B_T is None and plain.advantage is plain.advantage_B
    with pytest.raises(ValueError, match="trajectory one: 1 turns but 2 turn advantages"):
        collate([two_segment_trajectory(), one_turn_trajectory()], [9.0, 7.0], turn_advantages=[(0, 0, 0), (1, 2)])


def test_ppo_loss_and_aggregations_with_an_advantage_per_token_by_hand():
    logp_B_T = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    mask_B_T = torch.tensor([[True, True, False], [True, False, False]])
    advantage_B_T = torch.tensor([[1.0, 2.0, 5.0], [-1.0, 4.0, 4.0]])
    pl = ppo_clip_loss(logp_B_T, logp_B_T.detach(), advantage_B_T, mask_B_T)  # ratio 1: loss = -A per token
    assert torch.equal(pl.loss_B_T, torch.tensor([[-1.0, -2.0, 0.0], [1.0, 0.0, 0.0]]))
    assert token_mean(pl.loss_B_T, mask_B_T, 3).item() == pytest.approx(-2 / 3)  # (-1 - 2 + 1) / 3
    assert sequence_mean(pl.loss_B_T, mask_B_T, 2).item() == pytest.approx(-0.25)  # (-1.5 + 1) / 2
    token_mean(pl.loss_B_T, mask_B_T, 3).backward()
    assert torch.equal(logp_B_T.grad, torch.tensor([[-1 / 3, -2 / 3, 0.0], [1 / 3, 0.0, 0.0]]))
    # one advantage per sequence is the same as that advantage on each of its tokens, exactly
    advantage_B = torch.tensor([0.7, -1.3])
    assert torch.equal(per_token(advantage_B, logp_B_T), per_token(advantage_B[:, None].expand(2, 3), logp_B_T))
    with pytest.raises(ValueError, match=r"gspo_loss takes one advantage per sequence \(\[B\]\), got shape \(2, 3\)"):
        gspo_loss(logp_B_T, logp_B_T.detach(), advantage_B_T, mask_B_T)


def test_the_config_refuses_what_cannot_take_an_advantage_per_token():
    with pytest.raises(ValueError, match="^config error: algorithm.credit: gigpo gives each turn its own advantage, "
                                         "but loss: gspo has one ratio and one advantage per sequence"):
        load_config(None, ["algorithm.credit=gigpo", "algorithm.loss=gspo"])
    with pytest.raises(ValueError, match=r"^config error: algorithm.gamma: read only with credit: turn or gigpo"):
        load_config(None, ["algorithm.gamma=0.9"])
    with pytest.raises(ValueError, match=r"^config error: algorithm.step_weight: read only with credit: gigpo"):
        load_config(None, ["algorithm.credit=turn", "algorithm.step_weight=0.5"])
    with pytest.raises(ValueError, match=r"^config error: algorithm.credit: must be one of trajectory, turn, gigpo "
                                         r"\(got step\)$"):
        load_config(None, ["algorithm.credit=step"])
    algo = load_config(None, ["algorithm.credit=gigpo", "algorithm.gamma=0.95"]).algorithm
    assert credit_of(algo) is not None and credit_of(load_config(None, []).algorithm) is None


# -- the whole update, bit for bit ------------------------------------------------------------------
def episodes(policy, n: int = 8) -> list[TrajectoryGroup]:
    """Two groups of four real token sequences: a 6-token prompt, a 5-token turn, 3 tokens of tool output,
    a second turn of 3-6 tokens; outcomes 1, 0, 0, 1 and 0, 0, 1, 0 (the policy's own log-probs)."""
    gen = torch.Generator().manual_seed(1)
    outcomes = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    trajs = []
    for b in range(n):
        n_second = 3 + b % 4
        length = 6 + 5 + 3 + n_second
        ids = torch.randint(5, 1000, (1, length), generator=gen)
        with torch.no_grad():
            logp = token_logprobs(policy.model, ids, torch.ones_like(ids)).logp_B_T[0]
        mask = [0] * 6 + [1] * 5 + [0] * 3 + [1] * n_second
        lp = [0.0] + [float(logp[t - 1]) if mask[t] else 0.0 for t in range(1, length)]
        turns = (Turn(6, 11, "stop", 0, state="s0"), Turn(14, length, "stop", 0, state=f"s{b % 3}"))
        trajs.append(trajectory(outcomes[b], task_id=f"q{b // 4}", ids=ids[0].tolist(), prompt_len=6, mask=mask,
                                logprobs=lp, turns=turns))
    return scored_groups([TrajectoryGroup("q0", tuple(trajs[:4])), TrajectoryGroup("q1", tuple(trajs[4:]))])


def update_once(tiny_dir, credit_sets: list[str], sets: list[str]):
    base = [f"model.name={tiny_dir}", "model.lora_rank=8", "model.lora_alpha=16", "optim.lr=0.05",
            "rollout.tasks_per_step=2", "rollout.group_size=4"]
    cfg = load_config(None, [*base, *sets, *credit_sets])
    torch.manual_seed(0)
    policy = build_policy(cfg.model, cfg.optim, tiny_dir)
    groups = episodes(policy)
    adv = group_advantages(groups, grpo_advantages, credit_of(cfg.algorithm))
    batch = collate(adv.trajectories, adv.advantages, 0, adv.turn_advantages)
    stats = policy_update(policy, batch, cfg.algorithm, cfg.optim, 1.0, seed=3)
    return batch, stats, torch.cat([p.detach().flatten() for p in trainable_parameters(policy.model)])


@pytest.mark.parametrize("sets", [["algorithm.aggregation=token_mean"],
                                  ["algorithm.aggregation=sequence_mean", "algorithm.mini_batches=2"],
                                  ["algorithm.aggregation=constant", "optim.share_prefixes=false"]],
                         ids=["token_mean", "sequence_mean-2-steps", "constant-padded"])
def test_outcome_only_turn_credit_updates_exactly_as_trajectory_credit(tiny_dir, sets):
    batch, stats, weights = update_once(tiny_dir, [], sets)
    assert batch.advantage_B_T is None
    for credit in (["algorithm.credit=turn", "algorithm.gamma=1.0"],
                   ["algorithm.credit=gigpo", "algorithm.step_weight=0.0"]):
        per_turn, turn_stats, turn_weights = update_once(tiny_dir, credit, sets)
        assert per_turn.advantage_B_T is not None  # the other path, with the same numbers
        assert torch.equal(per_turn.advantage_B_T[per_turn.loss_mask_B_T],
                           batch.advantage_B[:, None].expand_as(batch.loss_mask_B_T)[batch.loss_mask_B_T])
        assert turn_stats == stats and torch.equal(turn_weights, weights)
    # and the numbers do change when the turns differ: GiGPO's step groups at weight 1
    _, gigpo_stats, gigpo_weights = update_once(tiny_dir, ["algorithm.credit=gigpo"], sets)
    assert not torch.equal(gigpo_weights, weights) and gigpo_stats["loss"] != stats["loss"]
