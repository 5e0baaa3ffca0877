"""The decoupled off-policy correction through the real update: a masked token is out of the loss's
numerator and its denominator; the update at one version of lag differs from the overlapped update of before
only by the correction; the behaviour/trainer mismatch per version lag, against counts worked out by hand.

Float64 on the tiny random model. Gradients are compared relative to the largest entry: to 1e-9 where the two
sides compute the same sums; to 1e-6 where one side is a difference of two gradients (observed 8e-8: single
tokens' gradients of the tiny random model are large and cancel in the sum, which amplifies float64 rounding).
A real difference moves gradients by far more (the correction below is a tenth of the gradient or more).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import Row, make_batch, tiny_config

from agent_rl.learn.batching import collate, split_steps
from agent_rl.learn.logprobs import Scoring, token_logprobs
from agent_rl.learn.loss import ppo_clip_loss, token_mean
from agent_rl.learn.policy import build_policy, trainable_parameters
from agent_rl.learn.update import PROXIMAL_RULES, fixed_logprobs, lags_of, policy_update

F64 = {"model.dtype": "float64", "optim.grad_clip": 1e9}  # no clipping: the gradients are compared as computed


def grads(policy) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in trainable_parameters(policy.model)])


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-9) -> bool:
    return bool((a - b).abs().max() <= rel * b.abs().max())


def own_logprobs(policy, batch, cfg):
    """The batch's proximal log-probs as the update's no-grad pass computes them."""
    scoring = Scoring(1.0, cfg.optim.logprob_chunk, policy.share_prefixes)
    return fixed_logprobs(policy, batch, cfg.algorithm, cfg.optim, scoring, PROXIMAL_RULES["recomputed"]
                          ).proximal_logp_B_T


def test_a_masked_token_counts_in_neither_the_numerator_nor_the_denominator(tiny_dir):
    """Behaviour = proximal everywhere (every weight 1) but at one token, where it is 3 nats lower: ratio
    e^3 = 20 > 2, so IcePop's token mask drops it. The update then equals, to float64 noise, the update of
    the same batch in which that token was never sampled (136 of 137 trained tokens, the step's denominator
    136 in both): the token changed neither the sum nor what it is divided by."""
    results = {}
    for case in ("masked", "unsampled"):
        sets = {**F64, "algorithm.mini_batches": 2}
        if case == "masked":
            sets.update({"algorithm.mismatch_mask": "token", "algorithm.mismatch_bounds": "[0.5, 2.0]"})
        cfg = tiny_config(tiny_dir, **sets)
        torch.manual_seed(0)
        policy = build_policy(cfg.model, cfg.optim, tiny_dir)
        batch = make_batch(policy)
        behaviour = own_logprobs(policy, batch, cfg).clone()
        behaviour[0, 10] -= 3.0
        batch = dataclasses.replace(batch, sampler_logp_B_T=behaviour)
        if case == "unsampled":
            mask = batch.loss_mask_B_T.clone()
            mask[0, 10] = False
            batch = dataclasses.replace(batch, loss_mask_B_T=mask, step_num_tokens=136)
        stats = policy_update(policy, batch, cfg.algorithm, cfg.optim, 1.0, seed=3)
        results[case] = stats, grads(policy)
    masked, unsampled = results["masked"], results["unsampled"]
    assert masked[0]["train_tokens"] == unsampled[0]["train_tokens"] == 136
    assert masked[0]["mis_dropped_frac"] == pytest.approx(1 / 137) and unsampled[0]["mis_dropped_frac"] == 0.0
    assert masked[0]["loss"] == pytest.approx(unsampled[0]["loss"], rel=1e-9)
    assert close(masked[1], unsampled[1])


def test_each_step_divides_by_the_tokens_it_trains():
    """split_steps' normalisers count `trained_mask_B_T`: rows of 2 and 3 sampled tokens, one of row 1's
    dropped by a mask: 4 trained tokens (not 5), 2 sequences; a row whose every token is dropped leaves the
    sequence count too."""
    batch = collate([Row((9, 1, 2), (0, 1, 1), (0.0, -1.0, -1.0)), Row((9, 3, 4, 5), (0, 1, 1, 1), (0.0,) * 4)],
                    [1.0, -1.0])
    keep = torch.ones_like(batch.loss_mask_B_T)
    keep[1, 1] = False
    (step,) = split_steps(dataclasses.replace(batch, keep_B_T=keep), 1)
    assert (batch.step_num_tokens, step.step_num_tokens, step.step_num_sequences) == (5, 4, 2)
    keep[0, :] = False
    (step,) = split_steps(dataclasses.replace(batch, keep_B_T=keep), 1)
    assert (step.step_num_tokens, step.step_num_sequences) == (2, 1)


def test_one_version_of_lag_differs_from_the_overlapped_update_only_by_the_correction(tiny_dir):
    """Rollouts one version stale (k = 1, what `algorithm.overlap_rollouts` trained on), one optimizer step.
    Before, the PPO ratio r = pi / pi_behaviour was clipped from the sampler's weights: a token's gradient was
    r A grad log pi, or 0 where the clip acted. Now the ratio is pi / pi_proximal (exactly 1 at the step) and
    the token is weighted by w = min(pi_proximal / pi_behaviour, cap) = min(r, cap): gradient w A grad log pi.
    So the new gradient minus the old is the gradient of -sum_t c_t A log pi(t) / N with c_t = min(r, cap) on
    the tokens the old clip zeroed and min(r, cap) - r on the others (0 below the cap): the decoupled correction
    and nothing else. Behaviour log-probs sit -0.6, -0.1, 0.1 or 0.4 nats from the trainer's (r = 1.82, 1.11,
    0.90, 0.67), advantages +-2: clipped-high, clipped-low, capped (cap 1.5) and plain tokens all occur."""
    cap = 1.5
    cfg = tiny_config(tiny_dir, **{**F64, "algorithm.tis_cap": cap})
    torch.manual_seed(0)
    policy = build_policy(cfg.model, cfg.optim, tiny_dir)
    batch = make_batch(policy)
    mask, adv = batch.loss_mask_B_T, batch.advantage_B[:, None].double()
    shifts = torch.tensor([-0.6, -0.1, 0.1, 0.4], dtype=torch.float64).repeat(batch.input_ids_B_T.numel())
    own = own_logprobs(policy, batch, cfg)
    behaviour = torch.where(mask, own + shifts[: own.numel()].view_as(own), 0.0)
    batch = dataclasses.replace(batch, sampler_logp_B_T=behaviour)
    n = int(mask.sum())

    def backward(loss_of_logp) -> torch.Tensor:
        policy.optimizer.zero_grad(set_to_none=True)
        logp = token_logprobs(policy.model, batch.input_ids_B_T, batch.attention_mask_B_T,
                              positions_B_T=mask).logp_B_T
        loss_of_logp(logp).backward()
        return grads(policy)

    policy.model.train()
    before = backward(lambda logp: token_mean(ppo_clip_loss(logp, behaviour, batch.advantage_B, mask, 0.2, 0.28
                                                            ).loss_B_T, mask, n))
    r = torch.exp(own - behaviour)
    clipped = mask & (((adv > 0) & (r > 1.28)) | ((adv < 0) & (r < 0.8)))
    c = torch.where(clipped, r.clamp(max=cap), r.clamp(max=cap) - r)
    assert int(clipped.sum()) > 10 and int((mask & ~clipped & (r > cap)).sum()) > 10  # both kinds occur
    correction = backward(lambda logp: -torch.where(mask, c * adv * logp, 0.0).sum() / n)
    policy.optimizer.zero_grad(set_to_none=True)
    stats = policy_update(policy, batch, cfg.algorithm, cfg.optim, 1.0, seed=3)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-12) and stats["clip_frac"] == 0.0
    assert close(grads(policy) - before, correction, rel=1e-6)
    assert (grads(policy) - before).abs().max() > 0.1 * before.abs().max()  # and it is no rounding


def test_the_mismatch_per_version_lag_as_counted_by_hand(tiny_dir):
    """Trainer at version 5. Rows 0-3 sampled by version 5 (lag 0) with behaviour = proximal; rows 4-7 by
    version 4 (lag 1) with behaviour 0.5 nats below proximal, but for one token 1.0 below (e^1 = 2.7 > cap 2).
    make_batch's rows have 18, 17, 16, 18 | 17, 16, 18, 17 sampled tokens: 69 at lag 0, 68 at lag 1.
    Lag 1's gap: (67 x 0.5 + 1.0) / 68 = 0.50735; its capped share 1/68; the batch's gap 34.5 / 137."""
    cfg = tiny_config(tiny_dir, **{**F64, "algorithm.mini_batches": 2})
    torch.manual_seed(0)
    policy = build_policy(cfg.model, cfg.optim, tiny_dir)
    batch = make_batch(policy)
    mask = batch.loss_mask_B_T
    version = torch.where(mask, torch.tensor([5] * 4 + [4] * 4)[:, None], -1)
    behaviour = own_logprobs(policy, batch, cfg).clone()
    behaviour[4:] -= 0.5
    behaviour[4, 10] -= 0.5
    batch = dataclasses.replace(batch, sampler_logp_B_T=torch.where(mask, behaviour, 0.0), version_B_T=version)
    assert [int(x) for x in mask.sum(dim=1)] == [18, 17, 16, 18, 17, 16, 18, 17]
    lag_B_T, lags = lags_of(batch, 5)
    assert lags == [0, 1] and int(lag_B_T[0, 6]) == 0 and int(lag_B_T[4, 6]) == 1
    stats = policy_update(policy, batch, cfg.algorithm, cfg.optim, 1.0, seed=3, version=5)
    want = {"lag0/token_share": 69 / 137, "lag0/logprob_gap_mean": 0.0, "lag0/tis_capped_frac": 0.0,
            "lag1/token_share": 68 / 137, "lag1/logprob_gap_mean": (67 * 0.5 + 1.0) / 68,
            "lag1/tis_capped_frac": 1 / 68, "lag1/mis_dropped_frac": 0.0,
            "logprob_gap_mean": 34.5 / 137, "tis_capped_frac": 1 / 137}
    assert {k: stats[k] for k in want} == pytest.approx(want, abs=1e-9)
    assert not any(k.startswith("lag") for k in policy_update(policy, batch, cfg.algorithm, cfg.optim, 1.0))
