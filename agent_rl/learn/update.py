"""One optimizer step of GRPO on a collated batch: micro-batches, loss, backward, clip, step
(`optimizer_step`, which SFT uses too).

Owns: choosing the loss variant and aggregation from the algorithm config (a lookup, not a branch
inside the loss), the optional reference pass (skipped when kl_beta == 0), truncated importance
sampling, gradient accumulation with the step's global denominators, and the step statistics.
Does not own: the maths of each loss (`learn.loss`), log-probs (`learn.logprobs`), what is in the batch.

Old log-probs. We take one optimizer step per batch of rollouts, so before that step the trainer's
policy *is* the policy that sampled: pi_old = pi.detach() and the PPO ratio is exactly 1 (the clip
then only matters when rollouts are stale). The sampler/trainer numerical mismatch is corrected by
truncated importance weights min(exp(logp_trainer - logp_sampler), cap). When rollouts are one
step stale (overlapped sampling), pi_old is the sampler's log-probs: the ratio carries the staleness
and is clipped, which is the importance-sampling correction PPO was built for.
"""

from __future__ import annotations

from typing import Any

import torch

from agent_rl.learn.allocator import release_freed_memory
from agent_rl.learn.batching import Batch, micro_batches
from agent_rl.learn.logprobs import reference_logprobs, token_logprobs
from agent_rl.learn.loss import (
    constant_normalised_sum,
    gspo_loss,
    k3_kl,
    mismatch_sequence_mask,
    ppo_clip_loss,
    sequence_mean,
    token_mean,
    truncated_importance_weights,
)

LOSSES = {"ppo": ppo_clip_loss, "gspo": gspo_loss}
# loss_B_T, mask_B_T, the step's batch, constant_norm_tokens -> the micro-batch's share of the step's loss
AGGREGATIONS = {
    "token_mean": lambda loss, mask, batch, norm: token_mean(loss, mask, batch.step_num_tokens),
    "sequence_mean": lambda loss, mask, batch, norm: sequence_mean(loss, mask, batch.step_num_sequences),
    "constant": lambda loss, mask, batch, norm: constant_normalised_sum(loss, mask, batch.step_num_sequences, norm),
}


def optimizer_step(optimizer: torch.optim.Optimizer, grad_clip: float) -> float:
    """Clip the accumulated gradients, step, and give the step's freed host memory back to the OS
    (`learn.allocator`). Returns the gradient norm before clipping (0 when nothing has a gradient)."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip)) if params else 0.0
    optimizer.step()
    release_freed_memory()
    return grad_norm


def policy_update(model: Any, optimizer: torch.optim.Optimizer, batch: Batch, algo: Any, optim: Any,
                  temperature: float, stale: bool = False) -> dict[str, float]:
    """Accumulate gradients over micro-batches, clip, step. Returns step statistics."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss_fn = LOSSES[algo.loss]
    sums: dict[str, float] = {}
    n_tok = 0

    def add(key: str, value: torch.Tensor, weight: int) -> None:
        sums[key] = sums.get(key, 0.0) + float(value) * weight

    total_loss = 0.0
    for mb in micro_batches(batch, max_tokens=optim.micro_batch_tokens):
        mask = mb.loss_mask_B_T
        k = int(mask.sum())
        out = token_logprobs(model, mb.input_ids_B_T, mb.attention_mask_B_T, temperature, optim.logprob_chunk)
        logp = out.logp_B_T  # [B, T], column t scores token t+1
        old = mb.sampler_logp_B_T if stale else logp.detach()
        pl = loss_fn(logp, old, mb.advantage_B, mask, eps_low=algo.eps_low, eps_high=algo.eps_high)
        per_token = pl.loss_B_T
        # sampler/trainer mismatch: always measured, corrected when tis_cap is set (not when stale:
        # the ratio against the sampler's log-probs already is the correction)
        iw = truncated_importance_weights(logp.detach(), mb.sampler_logp_B_T, mask, algo.tis_cap or 1e9)
        if algo.tis_cap and not stale:
            per_token = per_token * iw.weight_B_T
        if algo.mismatch_bounds:
            keep_B = mismatch_sequence_mask(logp.detach(), mb.sampler_logp_B_T, mask, *algo.mismatch_bounds)
            mask = mask & keep_B[:, None]
        if algo.kl_beta > 0:
            ref = reference_logprobs(model, mb.input_ids_B_T, mb.attention_mask_B_T, temperature,
                                     optim.logprob_chunk)
            kl_B_T = k3_kl(logp, ref, mask)
            per_token = per_token + algo.kl_beta * kl_B_T
            add("kl", torch.where(mask, kl_B_T.detach(), 0.0).sum() / max(k, 1), k)
        loss = AGGREGATIONS[algo.aggregation](per_token, mask, batch, algo.constant_norm_tokens)
        loss.backward()
        total_loss += float(loss.detach())
        gap = torch.where(mb.loss_mask_B_T, (logp.detach() - mb.sampler_logp_B_T).abs(), 0.0)
        add("entropy", torch.where(mb.loss_mask_B_T, out.entropy_B_T.detach(), 0.0).sum() / max(k, 1), k)
        add("clip_frac", pl.clip_frac, k)
        add("ratio_mean", pl.ratio_mean, k)
        add("approx_kl_old", pl.approx_kl, k)
        add("logprob_gap_mean", gap.sum() / max(k, 1), k)
        add("tis_capped_frac", iw.capped_frac, k)
        n_tok += k
    grad_norm = optimizer_step(optimizer, optim.grad_clip)
    stats = {k: v / max(n_tok, 1) for k, v in sums.items()}
    stats.update(loss=total_loss, grad_norm=grad_norm, train_tokens=float(n_tok))
    return stats
