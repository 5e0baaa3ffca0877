"""The policy update on one rollout batch: the proximal policy's log-probs (and the masks they decide) once
where needed, then epochs x mini-batches of optimizer steps (`policy_update`); one optimizer step of
accumulated micro-batches (`optimizer_step`, which SFT uses too).

Owns: the rules the config does not name but implies, each a table of lookups rather than branches inside
the loss (the proximal rules `PROXIMAL_RULES` chosen by `proximal_rule`, the off-policy corrections
`CORRECTIONS` chosen by `corrections`), the no-grad pass that fixes the proximal policy's log-probs, the masks
they decide and the KL reference's log-probs, a micro-batch's `LossTerms`, their aggregation, gradient
accumulation with each optimizer step's own denominators, and the update's statistics (among them the
behaviour/trainer mismatch per version lag).
Does not own: the maths of each loss and correction and the tables of the choices a config names (`learn.loss`:
`LOSSES`, `AGGREGATIONS`, `MISMATCH_MASKS`), scoring a micro-batch (`learn.logprobs`),
the reference policy (`learn.reference`), what is in the batch and how it is split (`learn.batching`).

Decoupled PPO (AReaL) is the one rule, whatever the batch's staleness. Three log-probs of each sampled token,
each its own named tensor (`Anchors`, and the gradient pass's own):
- behaviour: what the sampler reported, for the policy version that sampled the token (`Batch.version_B_T`)
  in vLLM's numerics. Asynchronous rollouts may be up to k (`algorithm.max_staleness`) versions behind the
  trainer: the token's lag is the trainer's version minus the token's;
- proximal: the trainer's own weights when the update starts (the current version). The PPO ratio
  pi / pi_proximal is measured and clipped from it, so the trust region is the trainer's whatever the lag
  (a ratio against the behaviour policy would start k versions away and clip most tokens);
- the current policy's, with gradient.
Each token's loss is weighted by pi_proximal / pi_behaviour (the maths: `learn.loss`), corrected as the config
says (`CORRECTIONS`): capped (TIS, `algorithm.tis_cap`), or the token (IcePop) or its whole sequence (geometric
mean) masked where the ratio leaves `algorithm.mismatch_bounds` (MIS, `algorithm.mismatch_mask`, a name from
`learn.loss.MISMATCH_MASKS`). Where the behaviour and proximal log-probs are equal every weight is 1 and the loss
is exactly the on-policy loss; with k = 0 the weight corrects the sampler/trainer mismatch of one version alone
(truncated importance sampling).

Where the proximal log-probs come from (`PROXIMAL_RULES`, chosen by `proximal_rule`):
- "current" (one optimizer step per batch, no mask): the gradient pass's own log-probs, detached. A separate
  pass over the same weights would give the same numbers, so it is skipped (the ratio is exactly 1);
- "recomputed" (several optimizer steps, or a mask): a no-grad pass before the first step, reused by every
  step: at the first step the ratio is 1, later ones move and get clipped.
Why a mask needs the no-grad pass: a masked token leaves the loss's numerator *and* its denominator (the
step's trained tokens or sequences, `Batch.trained_mask_B_T`), and an optimizer step's denominators are fixed
before its first micro-batch (so that micro-batch losses add up to the step's). Every token's mask must so be
known before the first step, from the proximal log-probs of the whole batch, not micro-batch by micro-batch in
the gradient pass (`fixed_logprobs`). A weight (TIS) changes no denominator: it is applied per micro-batch.
A new correction is one entry in `CORRECTIONS` and a small function in `learn.loss`; a new mask is one row of
`learn.loss.MISMATCH_MASKS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from agent_rl.core.config import OptimConfig
from agent_rl.learn.algorithm import AlgorithmConfig
from agent_rl.learn.allocator import release_freed_memory
from agent_rl.learn.batching import Batch, rank_micro_batches, share_rows, split_steps
from agent_rl.learn.distributed import Dist, all_reduce_adapter_grads, clip_grad_norm, reshard, sum_over_ranks
from agent_rl.learn.logprobs import Scoring, score
from agent_rl.learn.loss import AGGREGATIONS, LOSSES, MISMATCH_MASKS, k3_kl, truncated_importance_weights
from agent_rl.learn.policy import Policy

Tensor = torch.Tensor


# --- which log-probs the ratio and the corrections are measured against --------------------------------


@dataclass(frozen=True)
class Anchors:
    """A micro-batch's fixed log-probs ([B, T], no gradient, at its sampled tokens)."""

    behaviour_logp_B_T: Tensor  # the sampler's: the policy version that sampled each token, in vLLM's numerics
    proximal_logp_B_T: Tensor  # the trainer's weights when the update started: the PPO ratio's denominator


def _current_anchors(mb: Batch, logp_B_T: Tensor) -> Anchors:
    return Anchors(mb.sampler_logp_B_T, logp_B_T)


def _recomputed_anchors(mb: Batch, logp_B_T: Tensor) -> Anchors:
    assert mb.proximal_logp_B_T is not None, "the 'recomputed' rule needs fixed_logprobs' pass"
    return Anchors(mb.sampler_logp_B_T, mb.proximal_logp_B_T)


@dataclass(frozen=True)
class ProximalRule:
    """Where the proximal log-probs come from."""

    anchors: Callable[[Batch, Tensor], Anchors]  # (micro-batch, its current log-probs detached) -> its anchors
    recompute: bool  # needs the no-grad pass before the first step (`Batch.proximal_logp_B_T`)


PROXIMAL_RULES = {
    "current": ProximalRule(_current_anchors, recompute=False),
    "recomputed": ProximalRule(_recomputed_anchors, recompute=True),
}


def proximal_rule(algo: AlgorithmConfig) -> ProximalRule:
    """The rule for the proximal log-probs (module doc): recomputed once when there are several optimizer
    steps to keep them fixed over, or a mask to fix before the first step; else the gradient pass's own."""
    masks = any(CORRECTIONS[name].masks for name in corrections(algo))
    return PROXIMAL_RULES["recomputed" if algo.epochs * algo.mini_batches > 1 or masks else "current"]


@dataclass(frozen=True)
class Correction:
    """What one off-policy correction does to the policy loss."""

    weight_B_T: Tensor | float = 1.0  # multiplies the per-token policy loss
    keep_B_T: Tensor | bool = True  # tokens left in the loss (its numerator and denominators, and the KL term)


def _truncated_weights(anchors: Anchors, mask_B_T: Tensor, algo: AlgorithmConfig) -> Correction:
    """TIS: the loss of each token weighted by min(pi_proximal / pi_behaviour, `algorithm.tis_cap`)."""
    assert algo.tis_cap is not None, "chosen only with a cap (`corrections`)"
    tis = truncated_importance_weights(anchors.proximal_logp_B_T, anchors.behaviour_logp_B_T, mask_B_T,
                                       algo.tis_cap)
    return Correction(weight_B_T=tis.weight_B_T)


def _mismatch_mask(anchors: Anchors, mask_B_T: Tensor, algo: AlgorithmConfig) -> Correction:
    """MIS: the tokens (IcePop) or the sequences (geometric mean) whose pi_proximal / pi_behaviour leaves
    `algorithm.mismatch_bounds`, dropped (`algorithm.mismatch_mask`, a row of `learn.loss.MISMATCH_MASKS`)."""
    assert algo.mismatch_mask is not None, "chosen only with a mask (`corrections`)"
    keep = MISMATCH_MASKS[algo.mismatch_mask](anchors.proximal_logp_B_T, anchors.behaviour_logp_B_T, mask_B_T,
                                              *algo.mismatch_bounds)
    return Correction(keep_B_T=keep)


@dataclass(frozen=True)
class CorrectionRule:
    """One off-policy correction between the proximal and the behaviour policy."""

    apply: Callable[[Anchors, Tensor, AlgorithmConfig], Correction]  # (anchors, sampled mask, config)
    # it drops tokens: applied to the whole batch before the first step (module doc); else a weight, applied
    # to each micro-batch in the gradient pass
    masks: bool


CORRECTIONS: dict[str, CorrectionRule] = {
    "truncated_weights": CorrectionRule(_truncated_weights, masks=False),
    "mismatch_mask": CorrectionRule(_mismatch_mask, masks=True),
}


def corrections(algo: AlgorithmConfig) -> list[str]:
    """The off-policy corrections the config turns on, in table order."""
    on = {"truncated_weights": algo.tis_cap is not None, "mismatch_mask": algo.mismatch_mask is not None}
    return [name for name in CORRECTIONS if on[name]]


def _masked(batch: Batch, algo: AlgorithmConfig) -> Batch:
    """The batch with `keep_B_T`, the tokens every mask correction keeps, from the whole batch's proximal and
    behaviour log-probs (as it is: no mask on)."""
    masks = [name for name in corrections(algo) if CORRECTIONS[name].masks]
    if not masks:
        return batch
    anchors = _recomputed_anchors(batch, batch.sampler_logp_B_T)
    keep_B_T = torch.ones_like(batch.loss_mask_B_T)
    for name in masks:
        keep_B_T = keep_B_T & CORRECTIONS[name].apply(anchors, batch.loss_mask_B_T, algo).keep_B_T
    return replace(batch, keep_B_T=keep_B_T)


# --- one micro-batch ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossTerms:
    """One micro-batch's loss before aggregation, and its statistics."""

    policy_B_T: Tensor  # per-token policy-gradient loss, importance-weighted (0.0 where not trained)
    kl_B_T: Tensor | None  # per-token k3 KL to the reference; None without a KL term
    mask_B_T: Tensor  # bool: the tokens the aggregation counts (`Batch.trained_mask_B_T`)
    means: dict[str, Tensor]  # statistics, each a mean over the micro-batch's trained tokens
    # raw counts: trained_tokens (the weight of `means`), context_tokens (real tokens), computed_tokens
    # (positions the transformer body ran), and the mismatch sums (`_mismatch_sums`)
    sums: dict[str, float]


def _micro_terms(policy: Policy, mb: Batch, algo: AlgorithmConfig, scoring: Scoring, rule: ProximalRule,
                 lag_B_T: Tensor | None, lags: Sequence[int]) -> LossTerms:
    """A micro-batch scored by the policy with gradient: its loss terms against its anchors, and statistics."""
    trained = mb.trained_mask_B_T  # sampled, less what a mask correction dropped before the update (`_masked`)
    k = int(trained.sum())
    # only where tokens were sampled: the loss, its statistics and the corrections read nothing else
    out = score(policy.model, mb, scoring)
    logp = out.logp_B_T  # [B, T], column t scores token t+1 (0.0 where not sampled)
    anchors = rule.anchors(mb, logp.detach())
    pl = LOSSES[algo.loss].fn(logp, anchors.proximal_logp_B_T, mb.advantage, trained,
                              eps_low=algo.eps_low, eps_high=algo.eps_high)
    policy_B_T = pl.loss_B_T
    for name in corrections(algo):
        if not CORRECTIONS[name].masks:  # the masks are in `trained` already
            policy_B_T = policy_B_T * CORRECTIONS[name].apply(anchors, trained, algo).weight_B_T
    # the KL term where the batch carries the reference's log-probs (`fixed_logprobs`: when kl_beta > 0)
    kl_B_T = None if mb.ref_logp_B_T is None else k3_kl(logp, mb.ref_logp_B_T, trained)
    means = {} if kl_B_T is None else {"kl": torch.where(trained, kl_B_T.detach(), 0.0).sum() / max(k, 1)}
    means.update(entropy=torch.where(trained, out.entropy_B_T.detach(), 0.0).sum() / max(k, 1),
                 clip_frac=pl.clip_frac, ratio_mean=pl.ratio_mean, approx_kl_old=pl.approx_kl)
    sums = {"trained_tokens": float(k), "context_tokens": float(mb.attention_mask_B_T.sum()),
            "computed_tokens": float(out.computed_tokens), **_mismatch_sums(anchors, mb, algo, lag_B_T, lags)}
    return LossTerms(policy_B_T, kl_B_T, trained, means, sums)


def _mismatch_sums(anchors: Anchors, mb: Batch, algo: AlgorithmConfig, lag_B_T: Tensor | None,
                   lags: Sequence[int]) -> dict[str, float]:
    """The behaviour/trainer mismatch over the micro-batch's sampled tokens (masked ones too), whether or not
    anything corrects for it, as raw sums: tokens, |log pi_proximal - log pi_behaviour|, tokens whose ratio
    exceeds the TIS cap, tokens a mask dropped; over all of them and over those of each version lag in `lags`
    (`lag{n}/...`: sampled n versions before the trainer's)."""
    sampled = mb.loss_mask_B_T
    log_ratio_B_T = torch.where(sampled, anchors.proximal_logp_B_T - anchors.behaviour_logp_B_T, 0.0)
    capped_B_T = log_ratio_B_T > (math.log(algo.tis_cap) if algo.tis_cap is not None else math.inf)
    dropped_B_T = sampled & ~mb.trained_mask_B_T
    groups = {"": sampled}
    if lag_B_T is not None:
        groups.update({f"lag{n}/": sampled & (lag_B_T == n) for n in lags})
    out = {}
    for prefix, where in groups.items():
        out.update({f"{prefix}mismatch_tokens": float(where.sum()),
                    f"{prefix}gap_sum": float(torch.where(where, log_ratio_B_T.abs(), 0.0).sum()),
                    f"{prefix}capped_tokens": float((where & capped_B_T).sum()),
                    f"{prefix}dropped_tokens": float((where & dropped_B_T).sum())})
    return out


def _mismatch_stats(sums: dict[str, float], lags: Sequence[int]) -> dict[str, float]:
    """The update's mismatch statistics from the summed `_mismatch_sums`: the mean absolute log-prob gap, the
    shares of tokens capped and dropped; per version lag, those and the lag's share of the sampled tokens."""
    total = max(sums["mismatch_tokens"], 1.0)
    out = {"logprob_gap_mean": sums["gap_sum"] / total, "tis_capped_frac": sums["capped_tokens"] / total,
           "mis_dropped_frac": sums["dropped_tokens"] / total}
    for n in lags:
        tokens = max(sums[f"lag{n}/mismatch_tokens"], 1.0)
        out.update({f"lag{n}/token_share": sums[f"lag{n}/mismatch_tokens"] / total,
                    f"lag{n}/logprob_gap_mean": sums[f"lag{n}/gap_sum"] / tokens,
                    f"lag{n}/tis_capped_frac": sums[f"lag{n}/capped_tokens"] / tokens,
                    f"lag{n}/mis_dropped_frac": sums[f"lag{n}/dropped_tokens"] / tokens})
    return out


def _aggregate(terms: LossTerms, step: Batch, algo: AlgorithmConfig) -> Tensor:
    """The micro-batch's share of its optimizer step's loss: the KL term added, reduced as configured."""
    loss_B_T = terms.policy_B_T if terms.kl_B_T is None else terms.policy_B_T + algo.kl_beta * terms.kl_B_T
    return AGGREGATIONS[algo.aggregation](loss_B_T, terms.mask_B_T, step.step_num_tokens, step.step_num_sequences,
                                          algo.constant_norm_tokens)


@dataclass
class _Tally:
    """The update's statistics over every micro-batch: token-weighted means apart from raw sums."""

    weighted: dict[str, float] = field(default_factory=dict)  # each mean x its trained tokens, summed
    # trained_tokens (the denominator of `weighted`), context_tokens, computed_tokens, the mismatch sums, loss_sum
    sums: dict[str, float] = field(default_factory=dict)

    def add(self, terms: LossTerms) -> None:
        for key, mean in terms.means.items():
            self.weighted[key] = self.weighted.get(key, 0.0) + float(mean) * terms.sums["trained_tokens"]
        for key, count in terms.sums.items():
            self.add_sum(key, count)

    def add_sum(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value

    def over_ranks(self, dist: Dist) -> _Tally:
        """Every rank's tally summed (one process: this one)."""
        return _Tally(sum_over_ranks(self.weighted, dist), sum_over_ranks(self.sums, dist))

    def means(self) -> dict[str, float]:
        return {key: value / max(self.sums["trained_tokens"], 1) for key, value in self.weighted.items()}


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
    """The batch with `proximal_logp_B_T` (when the rule asks for the no-grad pass), `keep_B_T` (when a mask
    correction is on: decided on the whole batch, before any step's normalisers are counted) and `ref_logp_B_T`
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
            columns["proximal_logp_B_T"] = score(policy.model, mb, scoring).logp_B_T
        if reference is not None:
            columns["ref_logp_B_T"] = reference.logprobs(mb, scoring)
        assert mb.index_B is not None, "micro-batches of a collated batch know their rows"
        batch = batch.with_rows(mb.index_B, **columns)
    reshard(policy.model)  # several ranks: the layers this no-grad pass gathered, sharded again
    names = (("proximal_logp_B_T",) if rule.recompute else ()) + (("ref_logp_B_T",) if reference is not None else ())
    batch = share_rows(batch, policy.dist, names)  # every rank's rows, on every rank
    return _masked(batch, algo)


def lags_of(batch: Batch, version: int | None) -> tuple[Tensor | None, list[int]]:
    """([B, T] each token's version lag: `version` minus the version that sampled it, the version lags of the
    batch's sampled tokens, ascending); (None, []) where the batch or the caller gives no version. Every rank
    holds the whole batch, so every rank finds the same lags (the statistics' keys)."""
    if version is None or batch.version_B_T is None:
        return None, []
    lag_B_T = version - batch.version_B_T
    known = batch.loss_mask_B_T & (batch.version_B_T >= 0)
    return lag_B_T, sorted(set(lag_B_T[known].tolist()))


def policy_update(policy: Policy, batch: Batch, algo: AlgorithmConfig, optim: OptimConfig, temperature: float,
                  seed: int = 0, version: int | None = None) -> dict[str, float]:
    """epochs x mini_batches optimizer steps on one rollout batch, sampled by any policy versions (decoupled
    PPO: module doc). `seed` shuffles rows into mini-batches (a resumed run reshuffles the same way);
    `version`: the version of the weights the update starts from, which the batch's `version_B_T` is measured
    against (the mismatch statistics per version lag; None: none). Returns the update's statistics: per-token
    means over every step, loss and gradient norm per step, the mismatch (`_mismatch_stats`)."""
    scoring = Scoring(temperature, optim.logprob_chunk, policy.share_prefixes)
    rule = proximal_rule(algo)
    batch = fixed_logprobs(policy, batch, algo, optim, scoring, rule)
    _, lags = lags_of(batch, version)
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
                mb = mb.to(policy.device)
                terms = _micro_terms(policy, mb, algo, scoring, rule, lags_of(mb, version)[0], lags)
                tally.add(terms)
                micro = _aggregate(terms, step, algo)
                micro.backward()
                loss += float(micro.detach())
            all_reduce_adapter_grads(policy.replicated, policy.dist)  # the global gradient: a sum over ranks
            tally.add_sum("loss_sum", loss)  # this rank's share of the step's loss
            grad_norms.append(optimizer_step(policy.optimizer, optim.grad_clip))
    total = tally.over_ranks(policy.dist)
    out = {**total.means(), **_mismatch_stats(total.sums, lags)}
    # positions the body ran per real token: > 1 with padding, < 1 when packing shares prefixes
    out["computed_token_share"] = total.sums["computed_tokens"] / max(total.sums["context_tokens"], 1.0)
    steps = len(grad_norms)
    out.update(loss=total.sums["loss_sum"] / steps, grad_norm=sum(grad_norms) / steps,
               train_tokens=float(total.sums["trained_tokens"] / algo.epochs), optimizer_steps=float(steps))
    return out
