"""The policy-gradient loss, as pure functions of tensors, and the tables that name them.

Owns: the per-token objectives (`ppo_clip_loss` with DAPO's separate eps_low / eps_high, taking an
advantage per sequence or per token, `per_token`; `gspo_loss` with GSPO's sequence-level ratio), the k3 KL
penalty against a reference policy (`k3_kl`), the off-policy corrections between the proximal and the
behaviour policy (TIS: `truncated_importance_weights`; MIS: `mismatch_token_mask`, IcePop's two-sided token
mask, and `mismatch_sequence_mask`, the geometric-mean sequence mask) and the reductions to a scalar
(`token_mean`, `sequence_mean`, `constant_normalised_sum`); and the one table of each choice among them that
the `algorithm` config names: `LOSSES` (each loss with the clip range and reduction it implies where a config
leaves them out), `AGGREGATIONS`, `MISMATCH_MASKS`. The config's allowed names are these tables' keys
(`learn.algorithm`): a new loss is a pure function here and one row of `LOSSES`, nothing else.
Does not own: log-probs (`learn.logprobs`), tensors from trajectories (`learn.batching`), the optimizer
step and which correction applies when (`learn.update`), the config section (`learn.algorithm`).

Conventions. Every `_B_T` tensor is aligned the same way (see `learn.batching`): row b, column t holds the
quantity for the token at t + 1. `mask_B_T` is bool, True where that token was sampled by the
policy. Masked positions may hold anything (padding, ±1e9, ±inf, nan): every input goes
through `torch.where` *before* any arithmetic, so they change neither the loss nor the gradient
(a mask multiplication would turn inf * 0 into nan, and `where` on the output alone would still
send 0 * inf = nan back through exp). `old_logp` (the proximal policy's), reference and behaviour
(sampler) log-probs and advantages are constants: they are detached here.

Decoupled PPO (AReaL), the maths the update puts together (`learn.update`): a token sampled by the
behaviour policy pi_b (the sampler's weights, perhaps versions behind) is trained with

    loss_t = w_t * -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A),
    r_t = pi(t) / pi_prox(t),   w_t = pi_prox(t) / pi_b(t) (capped or masked, no gradient)

where pi_prox, the proximal policy, is the trainer's own weights when the update starts. Its gradient
is w_t r_t A grad log pi(t) inside the clip range: pi / pi_b, the importance weight that makes the
expectation under pi_b one under pi; the clip bounds how far pi moves from pi_prox, not from pi_b.

Normalisers are those of the whole optimizer step, passed in, so that summing the losses of
micro-batches gives exactly the loss (and gradient) of the full batch.

A step, put together (the loop does this; no function here branches on a variant name):

    keep = mask & mismatch_token_mask(prox_logp, behaviour_logp, mask, 0.5, 2.0)  # MIS: before the step
    pl = ppo_clip_loss(logp, prox_logp, advantage_B, keep, eps_low=0.2, eps_high=0.28)
    tis = truncated_importance_weights(prox_logp, behaviour_logp, keep, cap=2.0)
    loss_B_T = pl.loss_B_T * tis.weight_B_T
    loss_B_T = loss_B_T + beta * k3_kl(logp, ref_logp, keep)  # only when beta > 0
    loss = token_mean(loss_B_T, keep, step_num_tokens)  # step_num_tokens counts kept tokens only
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

Tensor = torch.Tensor


def _where(mask_B_T: Tensor, x_B_T: Tensor, fill: float = 0.0) -> Tensor:
    fill_ = torch.full((), fill, dtype=x_B_T.dtype, device=x_B_T.device)
    return torch.where(mask_B_T, x_B_T, fill_)


def _masked_mean(x_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """Mean over sampled tokens of a statistic (0 when there are none); no gradient."""
    with torch.no_grad():
        return _where(mask_B_T, x_B_T.float()).sum() / mask_B_T.sum().clamp(min=1)


_MAX_LOG_RATIO = 20.0  # e^20 = 4.9e8: far outside any clip range


def _clamp_log_ratio(log_ratio: Tensor) -> Tensor:
    """Keep exp(log_ratio) finite: an inf ratio would make the unchosen branch of the clipped
    objective backpropagate 0 * inf = nan. Only tokens with a ratio beyond e^20 are affected, and
    their gradient (zero when clipped, enormous otherwise) would be garbage anyway."""
    return torch.clamp(log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)


@dataclass(frozen=True)
class PolicyLoss:
    """Per-token loss of one micro-batch (exactly 0.0 at masked positions) and its statistics.

    The statistics are means over this micro-batch's sampled tokens, detached; weight them by
    `num_tokens` to average over micro-batches.
    """

    loss_B_T: Tensor
    ratio_mean: Tensor  # mean importance ratio pi / pi_old (token ratio, or the sequence ratio)
    approx_kl: Tensor  # k3 estimate of KL(pi_old || pi): mean of (ratio - 1) - log(ratio)
    clip_low_frac: Tensor  # A < 0 and ratio < 1 - eps_low: no gradient from these tokens
    clip_high_frac: Tensor  # A > 0 and ratio > 1 + eps_high
    num_tokens: Tensor

    @property
    def clip_frac(self) -> Tensor:
        return self.clip_low_frac + self.clip_high_frac


def _clipped_objective(
    log_ratio: Tensor, advantage: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), elementwise; plus r and the clip flags."""
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantage
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantage
    loss = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        clip_low = (advantage < 0) & (ratio < 1.0 - eps_low)
        clip_high = (advantage > 0) & (ratio > 1.0 + eps_high)
    return loss, ratio.detach(), clip_low, clip_high


def per_token(advantage: Tensor, like_B_T: Tensor) -> Tensor:
    """An advantage per sequence ([B]) spread over its tokens, or one per token ([B, T], credit per
    turn) as it is: [B, T], detached, in `like_B_T`'s dtype."""
    advantage = advantage.detach().to(like_B_T.dtype)
    return advantage[:, None].expand_as(like_B_T) if advantage.dim() == 1 else advantage


def ppo_clip_loss(
    logp_B_T: Tensor,
    old_logp_B_T: Tensor,
    advantage: Tensor,
    mask_B_T: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> PolicyLoss:
    """PPO-clip with a token-level ratio exp(logp - old_logp); eps_high > eps_low is DAPO's
    clip-higher (more room for unlikely tokens to grow).

    `old_logp_B_T`: the proximal policy's log-probs (the trainer's own when the update started), so
    the clip range is measured from the trainer's weights whatever policy version sampled the tokens.
    `advantage`: one per sequence ([B]) or one per token ([B, T], each turn its own: `learn.credit`).
    """
    # where() on the input: masked garbage never reaches exp
    log_ratio_B_T = _where(mask_B_T, _clamp_log_ratio(logp_B_T - old_logp_B_T.detach()))
    advantage_B_T = per_token(advantage, log_ratio_B_T)
    loss_B_T, ratio_B_T, clip_low_B_T, clip_high_B_T = _clipped_objective(
        log_ratio_B_T, advantage_B_T, eps_low, eps_high
    )
    return PolicyLoss(
        loss_B_T=_where(mask_B_T, loss_B_T),
        ratio_mean=_masked_mean(ratio_B_T, mask_B_T),
        approx_kl=_masked_mean(ratio_B_T - 1.0 - log_ratio_B_T.detach(), mask_B_T),
        clip_low_frac=_masked_mean(clip_low_B_T, mask_B_T),
        clip_high_frac=_masked_mean(clip_high_B_T, mask_B_T),
        num_tokens=mask_B_T.sum(),
    )


def gspo_loss(
    logp_B_T: Tensor,
    old_logp_B_T: Tensor,
    advantage_B: Tensor,
    mask_B_T: Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> PolicyLoss:
    """GSPO: one ratio per sequence, the geometric mean of its token ratios over sampled tokens,
    s_b = exp(mean_t (logp - old_logp)), clipped once per sequence.

    The sequence's loss is written to each of its sampled tokens, so `sequence_mean` gives GSPO's
    mean over sequences (`token_mean` would weight sequences by length). The default eps are the
    GSPO paper's: a sequence ratio moves far less than a token ratio. One ratio takes one advantage:
    an advantage per token (credit per turn) is a ValueError (the config refuses the pair first).
    """
    if advantage_B.dim() != 1:
        raise ValueError(f"gspo_loss takes one advantage per sequence ([B]), got shape {tuple(advantage_B.shape)}")
    log_ratio_B_T = _where(mask_B_T, logp_B_T - old_logp_B_T.detach())
    num_B = mask_B_T.sum(dim=-1)
    seq_log_ratio_B = _clamp_log_ratio(log_ratio_B_T.sum(dim=-1) / num_B.clamp(min=1))
    advantage_B = advantage_B.detach().to(logp_B_T.dtype)
    loss_B, ratio_B, clip_low_B, clip_high_B = _clipped_objective(
        seq_log_ratio_B, advantage_B, eps_low, eps_high
    )
    shape = mask_B_T.shape
    return PolicyLoss(
        loss_B_T=_where(mask_B_T, loss_B[:, None].expand(shape)),
        ratio_mean=_masked_mean(ratio_B[:, None].expand(shape), mask_B_T),
        approx_kl=_masked_mean(
            (ratio_B - 1.0 - seq_log_ratio_B.detach())[:, None].expand(shape), mask_B_T
        ),
        clip_low_frac=_masked_mean(clip_low_B[:, None].expand(shape), mask_B_T),
        clip_high_frac=_masked_mean(clip_high_B[:, None].expand(shape), mask_B_T),
        num_tokens=mask_B_T.sum(),
    )


def k3_kl(logp_B_T: Tensor, ref_logp_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref) on tokens sampled from pi:
    exp(ref - logp) - (ref - logp) - 1 (>= 0, unbiased). 0.0 at masked positions.

    Add `beta * k3_kl(...)` to the per-token loss. With beta = 0 the caller skips this and the
    reference forward pass altogether.
    """
    d_B_T = _where(mask_B_T, ref_logp_B_T.detach() - logp_B_T)
    return _where(mask_B_T, torch.exp(d_B_T) - d_B_T - 1.0)


@dataclass(frozen=True)
class ImportanceWeights:
    """Truncated importance weights pi_proximal / pi_behaviour (TIS)."""

    weight_B_T: Tensor  # min(exp(proximal_logp - behaviour_logp), cap); 1.0 at masked positions
    mean: Tensor  # over sampled tokens
    capped_frac: Tensor  # fraction of sampled tokens whose weight was capped


def truncated_importance_weights(
    proximal_logp_B_T: Tensor, behaviour_logp_B_T: Tensor, mask_B_T: Tensor, cap: float = 2.0
) -> ImportanceWeights:
    """Token-level TIS: each token's policy-gradient loss weighted by pi_proximal / pi_behaviour, capped so
    that a rare large ratio cannot blow up the step. The ratio carries both the staleness of the policy
    version that sampled (decoupled PPO) and the sampler/trainer mismatch of one version (vLLM and the
    trainer compute slightly different log-probs for the same weights).

    Multiply the policy loss (not the KL term) by `weight_B_T`; it carries no gradient.
    """
    with torch.no_grad():
        d_B_T = _where(mask_B_T, proximal_logp_B_T - behaviour_logp_B_T)
        raw_B_T = torch.exp(d_B_T)  # may be inf; the cap below makes it finite
        weight_B_T = _where(mask_B_T, torch.clamp(raw_B_T, max=cap), fill=1.0)
        return ImportanceWeights(
            weight_B_T=weight_B_T,
            mean=_masked_mean(weight_B_T, mask_B_T),
            capped_frac=_masked_mean(raw_B_T > cap, mask_B_T),
        )


def mismatch_token_mask(
    proximal_logp_B_T: Tensor,
    behaviour_logp_B_T: Tensor,
    mask_B_T: Tensor,
    low: float = 0.5,
    high: float = 2.0,
) -> Tensor:
    """keep_B_T: False for tokens whose pi_proximal / pi_behaviour is out of [low, high] (IcePop's
    two-sided mask: a token the two policies disagree on, either way, is dropped rather than down-weighted).

    Use as `mask_B_T & keep_B_T`, before the step's normalisers are counted: a dropped token leaves the
    loss's numerator and its denominator (`learn.update`). Positions outside `mask_B_T` are kept (True):
    the caller's mask already decides them.
    """
    with torch.no_grad():
        ratio_B_T = torch.exp(_where(mask_B_T, proximal_logp_B_T - behaviour_logp_B_T))
        return (ratio_B_T >= low) & (ratio_B_T <= high)


def mismatch_sequence_mask(
    proximal_logp_B_T: Tensor,
    behaviour_logp_B_T: Tensor,
    mask_B_T: Tensor,
    low: float = 0.5,
    high: float = 2.0,
) -> Tensor:
    """keep_B: False for sequences whose proximal/behaviour mismatch is out of [low, high].

    The sequence's mismatch ratio is the geometric mean of its token ratios over sampled tokens,
    exp(mean_t (proximal_logp - behaviour_logp)), so that long sequences are not dropped for length
    alone. Use as `mask_B_T & keep_B[:, None]`, before the step's normalisers are counted: a dropped
    sequence leaves the loss's numerator and its denominator (`learn.update`). A sequence without
    sampled tokens is kept (its ratio is 1).
    """
    with torch.no_grad():
        d_B_T = _where(mask_B_T, proximal_logp_B_T - behaviour_logp_B_T)
        ratio_B = torch.exp(d_B_T.sum(dim=-1) / mask_B_T.sum(dim=-1).clamp(min=1))
        return (ratio_B >= low) & (ratio_B <= high)


# --- reductions to a scalar ----------------------------------------------------------------


def token_mean(loss_B_T: Tensor, mask_B_T: Tensor, step_num_tokens: int) -> Tensor:
    """Sum over sampled tokens / sampled tokens of the whole optimizer step (DAPO token-level).

    Every token weighs the same whatever its sequence's length; micro-batch losses add up to the
    full-batch loss because the denominator is the step's, not the micro-batch's.
    """
    return _where(mask_B_T, loss_B_T).sum() / max(int(step_num_tokens), 1)


def sequence_mean(loss_B_T: Tensor, mask_B_T: Tensor, step_num_sequences: int) -> Tensor:
    """Mean over sampled tokens within each sequence, summed / sequences of the step (GRPO, GSPO).

    Sequences without sampled tokens contribute 0; count only sequences with sampled tokens in
    `step_num_sequences` (`batching.Batch.step_num_sequences` does). Each segment of a
    multi-segment trajectory is a sequence of its own here (`learn.batching`).
    """
    per_seq_B = _where(mask_B_T, loss_B_T).sum(dim=-1) / mask_B_T.sum(dim=-1).clamp(min=1)
    return per_seq_B.sum() / max(int(step_num_sequences), 1)


def constant_normalised_sum(
    loss_B_T: Tensor, mask_B_T: Tensor, step_num_sequences: int, max_tokens: int
) -> Tensor:
    """Sum over sampled tokens / (sequences in the step * a constant max_tokens) (Dr. GRPO).

    A constant denominator adds no length bias: a token's weight does not depend on how long its
    sequence, or the batch's other sequences, turned out to be.
    """
    return _where(mask_B_T, loss_B_T).sum() / (max(int(step_num_sequences), 1) * max_tokens)


# --- the tables the `algorithm` config names ------------------------------------------------------------------


class PolicyLossFn(Protocol):
    """A policy-gradient loss: (current, proximal log-probs [B, T], advantage [B] or [B, T], trained mask,
    the clip range) -> the per-token loss and its statistics."""

    def __call__(self, logp_B_T: Tensor, old_logp_B_T: Tensor, advantage: Tensor, mask_B_T: Tensor, /,
                 eps_low: float, eps_high: float) -> PolicyLoss: ...


@dataclass(frozen=True)
class Loss:
    """One `algorithm.loss`: its function, and what it implies for the fields a config leaves out."""

    fn: PolicyLossFn
    eps_low: float
    eps_high: float
    aggregation: str  # a key of AGGREGATIONS
    # takes one advantage per token (credit per turn); False: one ratio, so one advantage, per sequence
    per_token_advantages: bool = True


# DAPO's clip-higher for PPO; the GSPO paper's sequence-level ranges (a sequence ratio moves far less than a
# token ratio) and per-sequence mean
LOSSES: dict[str, Loss] = {
    "ppo": Loss(ppo_clip_loss, eps_low=0.2, eps_high=0.28, aggregation="token_mean"),
    "gspo": Loss(gspo_loss, eps_low=3e-4, eps_high=4e-4, aggregation="sequence_mean", per_token_advantages=False),
}

# (loss_B_T, mask_B_T, the step's trained tokens, the step's trained sequences, constant_norm_tokens) -> the
# micro-batch's share of its optimizer step's loss (`algorithm.aggregation`)
AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, int, int, int], Tensor]] = {
    "token_mean": lambda loss, mask, tokens, sequences, norm: token_mean(loss, mask, tokens),
    "sequence_mean": lambda loss, mask, tokens, sequences, norm: sequence_mean(loss, mask, sequences),
    "constant": lambda loss, mask, tokens, sequences, norm: constant_normalised_sum(loss, mask, sequences, norm),
}

# (proximal_logp_B_T, behaviour_logp_B_T, mask_B_T, low, high) -> the tokens kept, [B, T] or [B, 1]
# (`algorithm.mismatch_mask`)
MISMATCH_MASKS: dict[str, Callable[[Tensor, Tensor, Tensor, float, float], Tensor]] = {
    "token": mismatch_token_mask,
    "sequence": lambda proximal, behaviour, mask, low, high: mismatch_sequence_mask(
        proximal, behaviour, mask, low, high)[:, None],
}
