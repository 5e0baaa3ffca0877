"""The policy update on one rollout batch: old log-probs once, then epochs x mini-batches of optimizer
steps (`policy_update`); one optimizer step of accumulated micro-batches (`optimizer_step`, which SFT
uses too).

Owns: choosing the loss variant and aggregation from the algorithm config (lookups, not branches
inside the loss), the no-grad pass that fixes the old policy's (and the KL reference's) log-probs,
truncated importance sampling against the sampler, gradient accumulation with each optimizer step's
own denominators, and the update's statistics.
Does not own: the maths of each loss (`learn.loss`), log-probs (`learn.logprobs`), the reference
policy (`learn.reference`), what is in the batch (`learn.batching`).

The ratio. GRPO as DeepSeekMath, DAPO and GSPO define it takes several optimizer steps on one batch
of rollouts, with the PPO ratio pi / pi_old against the policy that sampled. `algorithm.epochs`
passes over the batch, each split into `algorithm.mini_batches` optimizer steps, give
epochs x mini_batches steps. pi_old is computed once, before the first step, by a no-grad pass of
the trainer (so trainer and ratio share numerics), and reused by every step: at the first step the
ratio is exactly 1, later ones move and get clipped. With one step per batch (the default) that
pass would equal the gradient pass, so it is skipped and pi_old = pi.detach(). The sampler/trainer
mismatch between vLLM and that pass is corrected by truncated importance weights
min(exp(logp_old - logp_sampler), cap). Rollouts one step stale (overlapped sampling) were sampled by
weights the trainer no longer has: pi_old is then the sampler's own log-probs, so the ratio carries the
staleness and is clipped, which is the importance-sampling correction PPO was built for.
"""

from __future__ import annotations

from typing import Any

import torch

from agent_rl.learn.allocator import release_freed_memory
from agent_rl.learn.batching import Batch, split_steps
from agent_rl.learn.distributed import (
    all_reduce_adapter_grads,
    clip_grad_norm,
    rank_micro_batches,
    reduce_stats,
    reshard,
    share_rows,
)
from agent_rl.learn.logprobs import token_logprobs
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
    """Clip the accumulated gradients (sharded ones too: `learn.distributed.clip_grad_norm`), step, and give
    the step's freed host memory back to the OS (`learn.allocator`). Returns the gradient norm before
    clipping (0 when nothing has a gradient)."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    grad_norm = clip_grad_norm(params, grad_clip)
    optimizer.step()
    release_freed_memory()
    return grad_norm


@torch.no_grad()
def fixed_logprobs(policy: Any, batch: Batch, algo: Any, optim: Any, temperature: float, stale: bool) -> Batch:
    """The batch with `old_logp_B_T` (pi_old, unless the gradient pass can stand in for it) and
    `ref_logp_B_T` (when the loss has a KL term), computed once, micro-batch by micro-batch."""
    need_old = not stale and algo.epochs * algo.mini_batches > 1
    if not need_old and algo.kl_beta == 0:
        return batch
    policy.model.eval()
    for mb in rank_micro_batches(batch, policy.dist, optim.micro_batch_tokens, policy.share_prefixes):  # this rank's
        mb = mb.to(policy.device)
        columns = {}
        if need_old:
            columns["old_logp_B_T"] = token_logprobs(policy.model, mb.input_ids_B_T, mb.attention_mask_B_T,
                                                     temperature, optim.logprob_chunk, mb.loss_mask_B_T,
                                                     policy.share_prefixes).logp_B_T
        if algo.kl_beta > 0:
            columns["ref_logp_B_T"] = policy.reference.logprobs(mb.input_ids_B_T, mb.attention_mask_B_T,
                                                                temperature, optim.logprob_chunk, mb.loss_mask_B_T,
                                                                policy.share_prefixes)
        batch = batch.with_rows(mb.index_B, **columns)
    reshard(policy.model)  # several ranks: the layers this no-grad pass gathered, sharded again
    names = (("old_logp_B_T",) if need_old else ()) + (("ref_logp_B_T",) if algo.kl_beta > 0 else ())
    return share_rows(batch, policy.dist, names)  # every rank's rows, on every rank


class _Stats:
    """Sums of per-token statistics, weighted by sampled tokens, over every micro-batch of the update."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.tokens = 0

    def add(self, key: str, value: torch.Tensor | float, weight: int) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + float(value) * weight

    def means(self) -> dict[str, float]:
        return {k: v / max(self.tokens, 1) for k, v in self.sums.items()}


def _micro_loss(policy: Any, mb: Batch, step: Batch, algo: Any, optim: Any, temperature: float,
                stale: bool, stats: _Stats) -> torch.Tensor:
    """One micro-batch's share of its optimizer step's loss (to backward), and its statistics."""
    mask = mb.loss_mask_B_T
    k = int(mask.sum())
    # only where tokens were sampled: the loss, its statistics and the importance weights read nothing else
    out = token_logprobs(policy.model, mb.input_ids_B_T, mb.attention_mask_B_T, temperature, optim.logprob_chunk,
                         mask, policy.share_prefixes)
    logp = out.logp_B_T  # [B, T], column t scores token t+1 (0.0 where not sampled)
    old = mb.sampler_logp_B_T if stale else mb.old_logp_B_T if mb.old_logp_B_T is not None else logp.detach()
    pl = LOSSES[algo.loss](logp, old, mb.advantage_B, mask, eps_low=algo.eps_low, eps_high=algo.eps_high)
    per_token = pl.loss_B_T
    # sampler/trainer mismatch of the sampling policy: always measured; corrected when tis_cap is set
    # (not when stale: the ratio against the sampler's log-probs already is the correction)
    iw = truncated_importance_weights(old, mb.sampler_logp_B_T, mask, algo.tis_cap or 1e9)
    if algo.tis_cap and not stale:
        per_token = per_token * iw.weight_B_T
    if algo.mismatch_bounds:
        keep_B = mismatch_sequence_mask(old, mb.sampler_logp_B_T, mask, *algo.mismatch_bounds)
        mask = mask & keep_B[:, None]
    if algo.kl_beta > 0:
        kl_B_T = k3_kl(logp, mb.ref_logp_B_T, mask)
        per_token = per_token + algo.kl_beta * kl_B_T
        stats.add("kl", torch.where(mask, kl_B_T.detach(), 0.0).sum() / max(k, 1), k)
    sampled = mb.loss_mask_B_T
    # sampler/trainer disagreement: on the sampling policy, or (stale) on the trainer's current one
    trainer = logp.detach() if stale else old
    gap = torch.where(sampled, (trainer - mb.sampler_logp_B_T).abs(), 0.0)
    stats.add("entropy", torch.where(sampled, out.entropy_B_T.detach(), 0.0).sum() / max(k, 1), k)
    stats.add("clip_frac", pl.clip_frac, k)
    stats.add("ratio_mean", pl.ratio_mean, k)
    stats.add("approx_kl_old", pl.approx_kl, k)
    stats.add("logprob_gap_mean", gap.sum() / max(k, 1), k)
    stats.add("tis_capped_frac", iw.capped_frac, k)
    stats.add("context_tokens", int(mb.attention_mask_B_T.sum()), 1)  # sums: their ratio is reported
    stats.add("computed_tokens", out.computed_tokens, 1)
    stats.tokens += k
    return AGGREGATIONS[algo.aggregation](per_token, mask, step, algo.constant_norm_tokens)


def policy_update(policy: Any, batch: Batch, algo: Any, optim: Any, temperature: float, stale: bool = False,
                  seed: int = 0) -> dict[str, float]:
    """epochs x mini_batches optimizer steps on one rollout batch (`policy` as `learn.policy.Policy`
    holds it). `seed` shuffles rows into mini-batches (a resumed run reshuffles the same way).
    Returns the update's statistics: per-token means over every step, loss and gradient norm per step."""
    batch = fixed_logprobs(policy, batch, algo, optim, temperature, stale)
    policy.model.train()
    generator = torch.Generator().manual_seed(seed)
    stats, losses, grad_norms = _Stats(), [], []
    for _ in range(algo.epochs):
        # a batch that lost groups without signal may hold fewer rows than mini-batches: one row each then
        num_steps = min(algo.mini_batches, batch.input_ids_B_T.shape[0])
        steps = split_steps(batch, num_steps, generator if num_steps > 1 else None)
        for step in steps:
            policy.optimizer.zero_grad(set_to_none=True)
            loss = 0.0
            for mb in rank_micro_batches(step, policy.dist, optim.micro_batch_tokens, policy.share_prefixes):
                micro = _micro_loss(policy, mb.to(policy.device), step, algo, optim, temperature, stale, stats)
                micro.backward()
                loss += float(micro.detach())
            all_reduce_adapter_grads(policy.replicated, policy.dist)  # the global gradient: a sum over ranks
            stats.add("loss_sum", loss, 1)
            losses.append(loss)
            grad_norms.append(optimizer_step(policy.optimizer, optim.grad_clip))
    stats.sums, stats.tokens = reduce_stats(stats.sums, stats.tokens, policy.dist)
    loss_sum = stats.sums.pop("loss_sum")  # every rank's share of every step's loss
    context, computed = stats.sums.pop("context_tokens"), stats.sums.pop("computed_tokens")
    out = stats.means()
    # positions the body ran per real token: > 1 with padding, < 1 when packing shares prefixes
    out["computed_token_share"] = computed / max(context, 1.0)
    out.update(loss=loss_sum / len(losses), grad_norm=sum(grad_norms) / len(grad_norms),
               train_tokens=float(stats.tokens / algo.epochs), optimizer_steps=float(len(losses)))
    return out
