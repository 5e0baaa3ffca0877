"""The policy update through the real `policy_update`: one step keeps the PPO ratio at 1; several steps
per rollout batch move it, clip it, and make clip-higher and GSPO matter; every variant runs. The decoupled
off-policy correction: weights and masks by hand, exactly the on-policy update where behaviour and proximal
agree, a masked token out of the numerator and the denominator, what changed from the overlapped update of
before, and the mismatch per version lag."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import Row, make_batch, tiny_config

from agent_rl.learn.algorithm import AlgorithmConfig
from agent_rl.learn.batching import collate
from agent_rl.learn.logprobs import Scoring, token_logprobs
from agent_rl.learn.policy import build_policy, trainable_parameters
from agent_rl.learn.update import (
    CORRECTIONS,
    PROXIMAL_RULES,
    corrections,
    fixed_logprobs,
    policy_update,
    proximal_rule,
)


def run(tiny_dir, shift: float = 0.0, **sets):
    cfg = tiny_config(tiny_dir, **sets)
    torch.manual_seed(0)
    policy = build_policy(cfg.model, cfg.optim, tiny_dir, with_reference=cfg.algorithm.kl_beta > 0)
    batch = make_batch(policy, shift)
    stats = policy_update(policy, batch, cfg.algorithm, cfg.optim, 1.0, seed=3)
    weights = torch.cat([p.detach().flatten() for p in trainable_parameters(policy.model)])
    return stats, weights


def test_one_step_keeps_the_ratio_at_one_so_clipping_never_acts(tiny_dir):
    stats, weights = run(tiny_dir)
    assert stats["optimizer_steps"] == 1.0
    assert stats["ratio_mean"] == 1.0 and stats["clip_frac"] == 0.0 and stats["approx_kl_old"] == 0.0
    # ... which is why, with one step, the clip range changes nothing at all
    _, no_clip_higher = run(tiny_dir, **{"algorithm.eps_high": 0.2})
    assert torch.equal(weights, no_clip_higher)


def test_four_mini_batches_move_the_ratio_and_clip(tiny_dir):
    stats, _ = run(tiny_dir, **{"algorithm.mini_batches": 4})
    # rows of 24, 23, 22, 24, 23, 22, 24, 23 tokens, 6 of prompt each: 137 sampled tokens, each counted once
    assert stats["optimizer_steps"] == 4.0 and stats["train_tokens"] == 137
    assert stats["clip_frac"] > 0.0 and stats["ratio_mean"] != pytest.approx(1.0, abs=1e-4)
    stats, _ = run(tiny_dir, **{"algorithm.epochs": 2, "algorithm.mini_batches": 2})
    assert stats["optimizer_steps"] == 4.0 and stats["clip_frac"] > 0.0


def test_the_first_step_of_several_starts_at_ratio_one(tiny_dir):
    """The proximal log-probs come from a separate no-grad pass (other micro-batches, eval mode): with one
    mini-batch and two epochs, the first epoch's ratio is 1 up to float noise, the second's is not."""
    cfg = tiny_config(tiny_dir, **{"algorithm.epochs": 1, "algorithm.mini_batches": 1})
    policy = build_policy(cfg.model, cfg.optim, tiny_dir)
    batch = make_batch(policy)
    forced = cfg.algorithm.model_copy(update={"epochs": 2})
    rule = proximal_rule(forced)
    assert rule is PROXIMAL_RULES["recomputed"] and rule.recompute
    scoring = Scoring(1.0, cfg.optim.logprob_chunk, policy.share_prefixes)
    fixed = fixed_logprobs(policy, batch, forced, cfg.optim, scoring, rule)
    with torch.no_grad():
        now = token_logprobs(policy.model, batch.input_ids_B_T, batch.attention_mask_B_T).logp_B_T
    gap = torch.where(batch.loss_mask_B_T, fixed.proximal_logp_B_T - now, 0.0).abs().max()
    assert float(gap) < 1e-5 and fixed.keep_B_T is None  # no mask configured


def test_each_proximal_rule_names_its_log_probs_and_the_corrections_act_as_worked_out():
    """One sampled token per row: the sampler reported -1.5 (behaviour), the no-grad pass -1.0, the current
    pass -0.7. The weight pi_proximal / pi_behaviour is e^0.5 = 1.6487 (recomputed) or e^0.8 = 2.2255 (current)."""
    batch = collate([Row((5, 6), (0, 1), (0.0, -1.5)), Row((5, 7), (0, 1), (0.0, -1.5))], [1.0, -1.0])
    batch = dataclasses.replace(batch, proximal_logp_B_T=torch.tensor([[-1.0, 0.0], [-1.0, 0.0]]))
    current = torch.tensor([[-0.7, 0.0], [-0.7, 0.0]])
    one_step, two_steps = AlgorithmConfig(), AlgorithmConfig(mini_batches=2)
    masked = AlgorithmConfig(mismatch_mask="token")
    assert proximal_rule(one_step) is PROXIMAL_RULES["current"]
    assert proximal_rule(two_steps) is proximal_rule(masked) is PROXIMAL_RULES["recomputed"]  # a mask needs the pass
    # (behaviour, proximal) at the sampled column: behaviour is always the sampler's
    want = {"current": (-1.5, -0.7), "recomputed": (-1.5, -1.0)}
    for name, rule in PROXIMAL_RULES.items():
        a = rule.anchors(batch, current)
        assert [float(a.behaviour_logp_B_T[0, 0]), float(a.proximal_logp_B_T[0, 0])] == pytest.approx(want[name])
    assert corrections(AlgorithmConfig(tis_cap=1.2, mismatch_mask="sequence")) == ["truncated_weights",
                                                                                   "mismatch_mask"]
    assert corrections(AlgorithmConfig(tis_cap=None)) == [] and corrections(masked) == ["truncated_weights",
                                                                                        "mismatch_mask"]
    assert corrections(AlgorithmConfig(tis_cap=None, mismatch_mask="token")) == ["mismatch_mask"]
    assert [n for n, c in CORRECTIONS.items() if c.masks] == ["mismatch_mask"]
    anchors = PROXIMAL_RULES["recomputed"].anchors(batch, current)
    mask = batch.loss_mask_B_T
    # TIS: 1.6487 capped at 1.2 on the sampled column, 1.0 elsewhere
    weights = CORRECTIONS["truncated_weights"].apply(anchors, mask, AlgorithmConfig(tis_cap=1.2)).weight_B_T
    assert weights.flatten().tolist() == pytest.approx([1.2, 1.0, 1.2, 1.0])
    # MIS: 1.6487 is inside [0.5, 2.0], outside [0.7, 1.5]; a token's mask and its one-token sequence's agree
    for kind in ("token", "sequence"):
        wide = AlgorithmConfig(mismatch_mask=kind)
        narrow = AlgorithmConfig(mismatch_mask=kind, mismatch_bounds=(0.7, 1.5))
        keep = CORRECTIONS["mismatch_mask"].apply(anchors, mask, wide).keep_B_T & mask
        assert keep.tolist() == [[True, False], [True, False]]
        keep = CORRECTIONS["mismatch_mask"].apply(anchors, mask, narrow).keep_B_T & mask
        assert keep.tolist() == [[False, False], [False, False]]


def test_a_lagged_batch_is_clipped_from_the_trainer_and_weighted_by_its_staleness(tiny_dir):
    """Behaviour log-probs 0.3 nats under the trainer's (a stale version): the ratio is taken against the
    trainer's own weights, so with one step it is exactly 1 and nothing clips (against the sampler, as the
    overlapped update of before did, it would start at e^0.3 = 1.35, past 1 + eps_high); the staleness is in
    the weight e^0.3, below the cap of 2."""
    stats, _ = run(tiny_dir, shift=-0.3)
    assert stats["ratio_mean"] == 1.0 and stats["clip_frac"] == 0.0
    assert stats["logprob_gap_mean"] == pytest.approx(0.3, abs=1e-4) and stats["tis_capped_frac"] == 0.0
    stats, _ = run(tiny_dir, shift=-0.8)  # e^0.8 = 2.23: every weight capped
    assert stats["tis_capped_frac"] == 1.0 and stats["mis_dropped_frac"] == 0.0


def test_equal_log_probs_give_exactly_the_on_policy_update(tiny_dir):
    """Behaviour = proximal, to the bit (the sampler's log-probs are the no-grad pass's own): every weight is
    e^0 = 1 and no ratio leaves any bounds, so TIS, the token mask and the sequence mask train exactly the
    weights that no correction trains, in float64 and in float32."""
    for dtype in ("float64", "float32"):
        results = {}
        for name, sets in {"none": {"algorithm.tis_cap": "null"}, "tis": {"algorithm.tis_cap": 1.01},
                           "token": {"algorithm.mismatch_mask": "token", "algorithm.mismatch_bounds": "[0.99, 1.01]"},
                           "sequence": {"algorithm.mismatch_mask": "sequence", "algorithm.tis_cap": "null"}}.items():
            cfg = tiny_config(tiny_dir, **{"model.dtype": dtype, "algorithm.mini_batches": 2, **sets})
            torch.manual_seed(0)
            policy = build_policy(cfg.model, cfg.optim, tiny_dir)
            batch = make_batch(policy)
            scoring = Scoring(1.0, cfg.optim.logprob_chunk, policy.share_prefixes)
            own = fixed_logprobs(policy, batch, cfg.algorithm, cfg.optim, scoring, PROXIMAL_RULES["recomputed"])
            batch = dataclasses.replace(batch, sampler_logp_B_T=own.proximal_logp_B_T.float())
            if dtype == "float64":
                batch = dataclasses.replace(batch, sampler_logp_B_T=own.proximal_logp_B_T)
            stats = policy_update(policy, batch, cfg.algorithm, cfg.optim, 1.0, seed=3)
            assert stats["logprob_gap_mean"] == 0.0 and stats["mis_dropped_frac"] == 0.0, (dtype, name)
            results[name] = torch.cat([p.detach().flatten() for p in trainable_parameters(policy.model)])
        for name in ("tis", "token", "sequence"):
            assert torch.equal(results[name], results["none"]), (dtype, name)


def test_clip_higher_and_gspo_change_the_update_once_steps_move_the_ratio(tiny_dir):
    several = {"algorithm.mini_batches": 4}
    _, dapo = run(tiny_dir, **several)
    _, symmetric = run(tiny_dir, **several, **{"algorithm.eps_high": 0.2})
    _, gspo = run(tiny_dir, **several, **{"algorithm.loss": "gspo"})
    assert not torch.equal(dapo, symmetric)
    assert (gspo - dapo).abs().max() > 1e-4


@pytest.mark.parametrize("sets", [
    {"algorithm.loss": "gspo"},
    {"algorithm.kl_beta": 0.1},
    {"algorithm.kl_beta": 0.1, "algorithm.mini_batches": 2},
    {"algorithm.mismatch_mask": "sequence"},
    {"algorithm.mismatch_mask": "token", "algorithm.loss": "gspo"},
    {"algorithm.aggregation": "sequence_mean"},
    {"algorithm.aggregation": "constant"},
    {"algorithm.tis_cap": "null"},
], ids=lambda s: ",".join(f"{k.split('.')[-1]}={v}" for k, v in s.items()))
def test_every_variant_runs_through_policy_update(tiny_dir, sets):
    stats, weights = run(tiny_dir, **sets)
    _, plain = run(tiny_dir)
    assert all(v == v for v in stats.values()), stats  # no nan
    assert stats["grad_norm"] > 0 and not torch.equal(weights, torch.zeros_like(weights))
    if sets.get("algorithm.kl_beta") and "algorithm.mini_batches" in sets:
        # the first step moves the policy off its start, so the second one feels the KL term
        assert stats["kl"] > 0.0 and not torch.equal(weights, run(tiny_dir, **{"algorithm.mini_batches": 2})[1])
    elif sets.get("algorithm.kl_beta"):
        # a fresh LoRA is its own reference before the first step: no KL, and a zero KL gradient
        assert stats["kl"] == 0.0 and torch.equal(weights, plain)


def test_a_kl_term_without_a_reference_is_a_one_line_error(tiny_dir):
    cfg = tiny_config(tiny_dir, **{"algorithm.kl_beta": 0.1})
    policy = build_policy(cfg.model, cfg.optim, tiny_dir)  # built without keeping its starting policy
    with pytest.raises(ValueError, match="kl_beta > 0 needs the policy's KL reference"):
        policy_update(policy, make_batch(policy), cfg.algorithm, cfg.optim, 1.0)


def test_mismatch_masks_drop_what_the_sampler_disagrees_on(tiny_dir):
    for kind in ("sequence", "token"):
        sets = {"algorithm.mismatch_mask": kind, "algorithm.mismatch_bounds": "[0.5, 2.0]"}
        stats, weights = run(tiny_dir, shift=-1.0, **sets)
        # exp(1.0) = 2.7 > 2: every token, every sequence dropped, nothing learned
        assert stats["grad_norm"] == 0.0 and stats["mis_dropped_frac"] == 1.0 and stats["train_tokens"] == 0.0
        stats, _ = run(tiny_dir, shift=-0.3, **sets)
        assert stats["grad_norm"] > 0.0 and stats["mis_dropped_frac"] == 0.0 and stats["train_tokens"] == 137


def test_shared_prompts_are_computed_once_with_the_same_update(tiny_dir):
    """Rows that share their 6-token prompt: packed, the body runs 6 + 137 positions for the 185 real
    tokens (0.773 of them; padded, 8 x 24 = 192: 1.038), and the gradient is the one padded rows give."""
    results = {}
    for share in (True, False):
        cfg = tiny_config(tiny_dir, **{"optim.share_prefixes": str(share).lower()})
        torch.manual_seed(0)
        policy = build_policy(cfg.model, cfg.optim, tiny_dir)
        assert policy.share_prefixes is share
        batch = make_batch(policy)
        batch = type(batch)(**{**batch.__dict__, "input_ids_B_T": batch.input_ids_B_T.clone()})
        batch.input_ids_B_T[:, :6] = batch.input_ids_B_T[0, :6]  # one prompt for every row
        stats = policy_update(policy, batch, cfg.algorithm, cfg.optim, 1.0, seed=3)
        # the gradient the optimizer stepped with (Adam's first step is ~lr * sign(gradient) for every
        # weight, so float32 noise in a near-zero gradient would flip a whole step: compare gradients)
        results[share] = stats, torch.cat([p.grad.flatten() for p in trainable_parameters(policy.model)])
    assert results[True][0]["computed_token_share"] == pytest.approx(143 / 185)
    assert results[False][0]["computed_token_share"] == pytest.approx(192 / 185)
    packed, padded = results[True][1], results[False][1]
    assert padded.abs().max() > 0
    assert (packed - padded).abs().max() < 1e-4 * padded.abs().max()
