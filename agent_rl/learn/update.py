"""The policy update on one rollout batch: pi_old's log-probs once where needed, then epochs x mini-batches
of optimizer steps (`policy_update`); one optimizer step of accumulated micro-batches (`optimizer_step`,
which SFT uses too).

Owns: the tables that turn the algorithm config into lookups, not branches inside the loss (`LOSSES`,
`AGGREGATIONS`, the proximal rules `PROXIMAL_RULES` chosen by `proximal_rule`, the importance corrections
`CORRECTIONS` chosen by `corrections`), the no-grad pass that fixes pi_old's (and the KL reference's)
log-probs, a micro-batch's `LossTerms`, their aggregation, gradient accumulation with each optimizer
step's own denominators, and the update's statistics.
Does not own: the maths of each loss and correction (`learn.loss`), scoring a micro-batch (`learn.logprobs`),
the reference policy (`learn.reference`), what is in the batch and how it is split (`learn.batching`).

Three log-probs of each sampled token, each its own named tensor (`Anchors`):
- behaviour: what the sampler reported, for the policy that sampled (vLLM's numerics);
- proximal: pi_old, the policy the PPO ratio pi / pi_old is measured and clipped from;
- the current policy's, with gradient, from this step's pass.
GRPO as DeepSeekMath, DAPO and GSPO define it takes several optimizer steps on one batch of rollouts.
`algorithm.epochs` passes over the batch, each split into `algorithm.mini_batches` optimizer steps, give
epochs x mini_batches steps. Which log-probs are proximal is one rule (`proximal_rule`):
- "recomputed" (several steps): a no-grad pass of the trainer before the first step (so trainer and ratio
  share numerics), reused by every step: at the first step the ratio is exactly 1, later ones move and
  get clipped;
- "current" (one step per batch, the default): that pass would equal the gradient pass, so it is skipped
  and pi_old = pi.detach();
- "sampler" (rollouts one step stale, overlapped sampling): they were sampled by weights the trainer no
  longer has, so pi_old is the sampler's own log-probs: the ratio carries the staleness and is clipped,
  which is the importance-sampling correction PPO was built for.
The importance corrections weight or mask the policy loss by pi_proximal / pi_behaviour, the
sampler/trainer mismatch: truncated importance weights min(ratio, cap) (`algorithm.tis_cap`), sequences
whose geometric-mean ratio leaves bounds dropped (`algorithm.mismatch_bounds`). Under the "sampler" rule
proximal is behaviour and none applies. A new rule (AReaL's decoupled PPO: proximal recomputed from the
current weights, behaviour the sampler's, the correction applied) or a new correction (IcePop's token
mask) is one entry in a table and a small function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from agent_rl.core.config import AlgorithmConfig, OptimConfig
from agent_rl.learn.allocator import release_freed_memory
from agent_rl.learn.batching import Batch, rank_micro_batches, share_rows, split_steps
from agent_rl.learn.distributed import Dist, all_reduce_adapter_grads, clip_grad_norm, reshard, sum_over_ranks
from agent_rl.learn.logprobs import Scoring, score
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
from agent_rl.learn.policy import Policy

Tensor = torch.Tensor

LOSSES = {"ppo": ppo_clip_loss, "gspo": gspo_loss}
# loss_B_T, mask_B_T, the step's batch, constant_norm_tokens -> the micro-batch's share of the step's loss
AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, Batch, int], Tensor]] = {
    "token_mean": lambda loss, mask, batch, norm: token_mean(loss, mask, batch.step_num_tokens),
    "sequence_mean": lambda loss, mask, batch, norm: sequence_mean(loss, mask, batch.step_num_sequences),
    "constant": lambda loss, mask, batch, norm: constant_normalised_sum(loss, mask, batch.step_num_sequences, norm),
}


# --- which log-probs the ratio and the corrections are measured against --------------------------------


@dataclass(frozen=True)
class Anchors:
    """A micro-batch's fixed log-probs ([B, T], no gradient, at its sampled tokens)."""

    behaviour_logp_B_T: Tensor  # what the sampler reported: the policy that sampled, in vLLM's numerics
    proximal_logp_B_T: Tensor  # pi_old: the policy the PPO ratio is measured and clipped from
    # the trainer's log-probs nearest the sampling policy (its own recomputation of it, or, when it no longer
    # has those weights, the current ones): the trainer side of the `logprob_gap_mean` statistic
    trainer_logp_B_T: Tensor


def _current_anchors(mb: Batch, logp_B_T: Tensor) -> Anchors:
    return Anchors(mb.sampler_logp_B_T, logp_B_T, logp_B_T)


def _recomputed_anchors(mb: Batch, logp_B_T: Tensor) -> Anchors:
    assert mb.recomputed_logp_B_T is not None, "the 'recomputed' rule needs fixed_logprobs' pass"
    return Anchors(mb.sampler_logp_B_T, mb.recomputed_logp_B_T, mb.recomputed_logp_B_T)


def _sampler_anchors(mb: Batch, logp_B_T: Tensor) -> Anchors:
    return Anchors(mb.sampler_logp_B_T, mb.sampler_logp_B_T, logp_B_T)


@dataclass(frozen=True)
class ProximalRule:
    """Where pi_old comes from, and what follows from that."""

    anchors: Callable[[Batch, Tensor], Anchors]  # (micro-batch, its current log-probs detached) -> its anchors
    recompute: bool  # needs the no-grad pass before the first step (`Batch.recomputed_logp_B_T`)
    corrects: bool  # the importance corrections apply (False: the ratio against the sampler already is one)


PROXIMAL_RULES = {
    "current": ProximalRule(_current_anchors, recompute=False, corrects=True),
    "recomputed": ProximalRule(_recomputed_anchors, recompute=True, corrects=True),
    "sampler": ProximalRule(_sampler_anchors, recompute=False, corrects=False),
}


def proximal_rule(algo: AlgorithmConfig, stale: bool) -> ProximalRule:
    """The rule for pi_old (module doc): the sampler's for stale rollouts, else the trainer's, recomputed
    once when there are several optimizer steps to keep it fixed over."""
    name = "sampler" if stale else "recomputed" if algo.epochs * algo.mini_batches > 1 else "current"
    return PROXIMAL_RULES[name]


@dataclass(frozen=True)
class Correction:
    """What one importance correction does to a micro-batch's policy loss."""

    weight_B_T: Tensor | float = 1.0  # multiplies the per-token policy loss
    keep_B_T: Tensor | bool = True  # tokens left in the loss (and its KL term)


def _truncated_weights(anchors: Anchors, mask_B_T: Tensor, algo: AlgorithmConfig) -> Correction:
    """TIS: the loss of each token weighted by min(pi_proximal / pi_behaviour, `algorithm.tis_cap`)."""
    assert algo.tis_cap is not None, "chosen only with a cap (`corrections`)"
    tis = truncated_importance_weights(anchors.proximal_logp_B_T, anchors.behaviour_logp_B_T, mask_B_T,
                                       algo.tis_cap)
    return Correction(weight_B_T=tis.weight_B_T)


def _sequence_bounds(anchors: Anchors, mask_B_T: Tensor, algo: AlgorithmConfig) -> Correction:
    """Sequences whose geometric-mean pi_proximal / pi_behaviour leaves `algorithm.mismatch_bounds`, dropped."""
    assert algo.mismatch_bounds is not None, "chosen only with bounds (`corrections`)"
    keep_B = mismatch_sequence_mask(anchors.proximal_logp_B_T, anchors.behaviour_logp_B_T, mask_B_T,
                                    *algo.mismatch_bounds)
    return Correction(keep_B_T=keep_B[:, None])


CORRECTIONS: dict[str, Callable[[Anchors, Tensor, AlgorithmConfig], Correction]] = {
    "truncated_weights": _truncated_weights,
    "sequence_bounds": _sequence_bounds,
}


def corrections(algo: AlgorithmConfig, rule: ProximalRule) -> list[str]:
    """The importance corrections the config turns on, in the order they apply; none where the rule's
    ratio already is the correction."""
    on = {"truncated_weights": algo.tis_cap is not None, "sequence_bounds": algo.mismatch_bounds is not None}
    return [name for name in CORRECTIONS if on[name] and rule.corrects]


# --- one micro-batch ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossTerms:
    """One micro-batch's loss before aggregation, and its statistics."""

    policy_B_T: Tensor  # per-token policy-gradient loss, importance-corrected (0.0 where not sampled)
    kl_B_T: Tensor | None  # per-token k3 KL to the reference; None without a KL term
    mask_B_T: Tensor  # bool: the tokens the aggregation counts (sampled, less sequences a correction dropped)
    means: dict[str, Tensor]  # statistics, each a mean over the micro-batch's sampled tokens
    # raw counts: sampled_tokens (the weight of `means`), context_tokens (real tokens), computed_tokens
    # (positions the transformer body ran)
    sums: dict[str, int]


def _micro_terms(policy: Policy, mb: Batch, algo: AlgorithmConfig, scoring: Scoring,
                 rule: ProximalRule) -> LossTerms:
    """A micro-batch scored by the policy with gradient: its loss terms against its anchors, and statistics."""
    sampled = mb.loss_mask_B_T
    k = int(sampled.sum())
    # only where tokens were sampled: the loss, its statistics and the corrections read nothing else
    out = score(policy.model, mb, scoring)
    logp = out.logp_B_T  # [B, T], column t scores token t+1 (0.0 where not sampled)
    anchors = rule.anchors(mb, logp.detach())
    pl = LOSSES[algo.loss](logp, anchors.proximal_logp_B_T, mb.advantage, sampled,
                           eps_low=algo.eps_low, eps_high=algo.eps_high)
    policy_B_T, mask = pl.loss_B_T, sampled
    for name in corrections(algo, rule):
        correction = CORRECTIONS[name](anchors, sampled, algo)
        policy_B_T, mask = policy_B_T * correction.weight_B_T, mask & correction.keep_B_T
    # the KL term where the batch carries the reference's log-probs (`fixed_logprobs`: when kl_beta > 0)
    kl_B_T = None if mb.ref_logp_B_T is None else k3_kl(logp, mb.ref_logp_B_T, mask)
    means = {} if kl_B_T is None else {"kl": torch.where(mask, kl_B_T.detach(), 0.0).sum() / max(k, 1)}
    means.update(entropy=torch.where(sampled, out.entropy_B_T.detach(), 0.0).sum() / max(k, 1),
                 clip_frac=pl.clip_frac, ratio_mean=pl.ratio_mean, approx_kl_old=pl.approx_kl,
                 **_mismatch_stats(anchors, sampled, k, algo))
    sums = {"sampled_tokens": k, "context_tokens": int(mb.attention_mask_B_T.sum()),
            "computed_tokens": out.computed_tokens}
    return LossTerms(policy_B_T, kl_B_T, mask, means, sums)


def _mismatch_stats(anchors: Anchors, sampled: Tensor, k: int, algo: AlgorithmConfig) -> dict[str, Tensor]:
    """Sampler/trainer disagreement, whether or not anything corrects for it: the mean absolute log-prob gap,
    and the share of tokens whose pi_proximal / pi_behaviour exceeds the TIS cap (1e9 without one)."""
    gap = torch.where(sampled, (anchors.trainer_logp_B_T - anchors.behaviour_logp_B_T).abs(), 0.0)
    cap = algo.tis_cap if algo.tis_cap is not None else 1e9
    tis = truncated_importance_weights(anchors.proximal_logp_B_T, anchors.behaviour_logp_B_T, sampled, cap)
    return {"logprob_gap_mean": gap.sum() / max(k, 1), "tis_capped_frac": tis.capped_frac}


def _aggregate(terms: LossTerms, step: Batch, algo: AlgorithmConfig) -> Tensor:
    """The micro-batch's share of its optimizer step's loss: the KL term added, reduced as configured."""
    loss_B_T = terms.policy_B_T if terms.kl_B_T is None else terms.policy_B_T + algo.kl_beta * terms.kl_B_T
    return AGGREGATIONS[algo.aggregation](loss_B_T, terms.mask_B_T, step, algo.constant_norm_tokens)


@dataclass
class _Tally:
    """The update's statistics over every micro-batch: token-weighted means apart from raw sums."""

    weighted: dict[str, float] = field(default_factory=dict)  # each mean x its sampled tokens, summed
    # sampled_tokens (the denominator of `weighted`), context_tokens, computed_tokens, loss_sum
    sums: dict[str, float] = field(default_factory=dict)

    def add(self, terms: LossTerms) -> None:
        for key, mean in terms.means.items():
            self.weighted[key] = self.weighted.get(key, 0.0) + float(mean) * terms.sums["sampled_tokens"]
        for key, count in terms.sums.items():
            self.add_sum(key, count)

    def add_sum(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value

    def over_ranks(self, dist: Dist) -> _Tally:
        """Every rank's tally summed (one process: this one)."""
        return _Tally(sum_over_ranks(self.weighted, dist), sum_over_ranks(self.sums, dist))

    def means(self) -> dict[str, float]:
        return {key: value / max(self.sums["sampled_tokens"], 1) for key, value in self.weighted.items()}


# --- the update ---------------------------------------------------------------------------------------


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
def fixed_logprobs(policy: Policy, batch: Batch, algo: AlgorithmConfig, optim: OptimConfig, scoring: Scoring,
                   rule: ProximalRule) -> Batch:
    """The batch with `recomputed_logp_B_T` (when the rule asks for the no-grad pass) and `ref_logp_B_T`
    (when the loss has a KL term), computed once, micro-batch by micro-batch, each rank its own rows."""
    if not rule.recompute and algo.kl_beta == 0:
        return batch
    reference = policy.reference if algo.kl_beta > 0 else None
    if algo.kl_beta > 0 and reference is None:
        raise ValueError("algorithm.kl_beta > 0 needs the policy's KL reference (build_policy(with_reference=True))")
    policy.model.eval()
    for mb in rank_micro_batches(batch, policy.dist, optim.micro_batch_tokens, scoring.share_prefixes):
        mb = mb.to(policy.device)
        columns: dict[str, Tensor] = {}
        if rule.recompute:
            columns["recomputed_logp_B_T"] = score(policy.model, mb, scoring).logp_B_T
        if reference is not None:
            columns["ref_logp_B_T"] = reference.logprobs(mb, scoring)
        assert mb.index_B is not None, "micro-batches of a collated batch know their rows"
        batch = batch.with_rows(mb.index_B, **columns)
    reshard(policy.model)  # several ranks: the layers this no-grad pass gathered, sharded again
    names = (("recomputed_logp_B_T",) if rule.recompute else ()) + (("ref_logp_B_T",) if reference is not None else ())
    return share_rows(batch, policy.dist, names)  # every rank's rows, on every rank


def policy_update(policy: Policy, batch: Batch, algo: AlgorithmConfig, optim: OptimConfig, temperature: float,
                  stale: bool = False, seed: int = 0) -> dict[str, float]:
    """epochs x mini_batches optimizer steps on one rollout batch. `stale`: the rollouts were sampled by the
    weights before the last update (overlapped sampling). `seed` shuffles rows into mini-batches (a resumed
    run reshuffles the same way). Returns the update's statistics: per-token means over every step, loss and
    gradient norm per step."""
    scoring = Scoring(temperature, optim.logprob_chunk, policy.share_prefixes)
    rule = proximal_rule(algo, stale)
    batch = fixed_logprobs(policy, batch, algo, optim, scoring, rule)
    policy.model.train()
    generator = torch.Generator().manual_seed(seed)
    tally, grad_norms = _Tally(), []
    for _ in range(algo.epochs):
        # a batch that lost groups without signal may hold fewer rows than mini-batches: one row each then
        num_steps = min(algo.mini_batches, batch.input_ids_B_T.shape[0])
        for step in split_steps(batch, num_steps, generator if num_steps > 1 else None):
            policy.optimizer.zero_grad(set_to_none=True)
            loss = 0.0
            for mb in rank_micro_batches(step, policy.dist, optim.micro_batch_tokens, scoring.share_prefixes):
                terms = _micro_terms(policy, mb.to(policy.device), algo, scoring, rule)
                tally.add(terms)
                micro = _aggregate(terms, step, algo)
                micro.backward()
                loss += float(micro.detach())
            all_reduce_adapter_grads(policy.replicated, policy.dist)  # the global gradient: a sum over ranks
            tally.add_sum("loss_sum", loss)  # this rank's share of the step's loss
            grad_norms.append(optimizer_step(policy.optimizer, optim.grad_clip))
    total = tally.over_ranks(policy.dist)
    out = total.means()
    # positions the body ran per real token: > 1 with padding, < 1 when packing shares prefixes
    out["computed_token_share"] = total.sums["computed_tokens"] / max(total.sums["context_tokens"], 1.0)
    steps = len(grad_norms)
    out.update(loss=total.sums["loss_sum"] / steps, grad_norm=sum(grad_norms) / steps,
               train_tokens=float(total.sums["sampled_tokens"] / algo.epochs), optimizer_steps=float(steps))
    return out
