"""Loss variants and reductions against numbers worked out by hand; masking and micro-batching."""

import math

import pytest
import torch
from torch import nn

from agent_rl.learn.loss import (
    constant_normalised_sum,
    gspo_loss,
    k3_kl,
    mismatch_sequence_mask,
    mismatch_token_mask,
    ppo_clip_loss,
    sequence_mean,
    token_mean,
    truncated_importance_weights,
)

ATOL = 1e-6


def _close(actual, expected, atol=ATOL):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        atol=atol,
        rtol=0,
    )


# --- PPO-clip -------------------------------------------------------------------------------
# Two sequences, three positions; the last position of row 1 is not sampled.
# ratios r = [[1.5, 0.5, 1.1], [1.5, 0.5, (0.9)]], advantages A = [2, -1], eps_low .2, eps_high .28
# row 0 (A = 2):  r=1.5: min(3.0, 1.28*2=2.56) = 2.56 -> loss -2.56 (clipped high, no gradient)
#                 r=0.5: min(1.0, 0.8*2=1.6)   = 1.0  -> loss -1.0
#                 r=1.1: min(2.2, 2.2)         = 2.2  -> loss -2.2
# row 1 (A = -1): r=1.5: min(-1.5, -1.28)      = -1.5 -> loss 1.5
#                 r=0.5: min(-0.5, -0.8)       = -0.8 -> loss 0.8 (clipped low, no gradient)
# sum = -2.56 - 1.0 - 2.2 + 1.5 + 0.8 = -3.46 over 5 sampled tokens
MASK = torch.tensor([[True, True, True], [True, True, False]])
OLD = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
RATIOS = torch.tensor([[1.5, 0.5, 1.1], [1.5, 0.5, 0.9]])
ADV = torch.tensor([2.0, -1.0])


def _ppo_inputs():
    logp = (OLD + RATIOS.log()).requires_grad_(True)
    return logp, OLD.clone(), ADV.clone(), MASK.clone()


def test_ppo_clip_loss_by_hand():
    logp, old, adv, mask = _ppo_inputs()
    pl = ppo_clip_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    _close(pl.loss_B_T, [[-2.56, -1.0, -2.2], [1.5, 0.8, 0.0]])
    assert pl.num_tokens.item() == 5
    _close(pl.clip_high_frac, 1 / 5)  # row 0, r=1.5
    _close(pl.clip_low_frac, 1 / 5)  # row 1, r=0.5
    _close(pl.clip_frac, 2 / 5)
    _close(pl.ratio_mean, (1.5 + 0.5 + 1.1 + 1.5 + 0.5) / 5)  # 1.02
    # k3 of each ratio: (r - 1) - ln r
    k = lambda r: (r - 1) - math.log(r)  # noqa: E731
    # 1.5 -> .0945349, 0.5 -> .1931472, 1.1 -> .0046898; (2*.0945349 + 2*.1931472 + .0046898)/5
    _close(pl.approx_kl, (2 * k(1.5) + 2 * k(0.5) + k(1.1)) / 5)
    _close(pl.approx_kl, 0.1160108, atol=1e-6)


def test_ppo_clip_gradient_by_hand():
    logp, old, adv, mask = _ppo_inputs()
    pl = ppo_clip_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    token_mean(pl.loss_B_T, mask, step_num_tokens=5).backward()
    # d(-r A)/d logp = -A r where the unclipped term is chosen, 0 where the clipped one is
    # row 0: [0 (clipped), -2*0.5 = -1.0, -2*1.1 = -2.2]
    # row 1: [1*1.5 = 1.5, 0 (clipped), 0 (masked)]
    # divided by the 5 tokens of the step
    _close(logp.grad, [[0.0, -0.2, -0.44], [0.3, 0.0, 0.0]])


def test_symmetric_clip_differs_from_clip_higher():
    logp, old, adv, mask = _ppo_inputs()
    pl = ppo_clip_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    # row 0, r=1.5, A=2: min(3.0, 1.2*2) = 2.4 -> -2.4 instead of -2.56
    _close(pl.loss_B_T[0, 0], -2.4)


# --- reductions ---------------------------------------------------------------------------


def test_reductions_by_hand():
    loss_B_T = torch.tensor([[-2.56, -1.0, -2.2], [1.5, 0.8, math.inf]])  # inf sits under the mask
    # token mean: -3.46 / 5 = -0.692; with a step of 10 tokens: -0.346
    _close(token_mean(loss_B_T, MASK, 5), -0.692)
    _close(token_mean(loss_B_T, MASK, 10), -0.346)
    # sequence mean: row 0 -5.76/3 = -1.92, row 1 2.3/2 = 1.15; (-1.92 + 1.15) / 2 = -0.385
    _close(sequence_mean(loss_B_T, MASK, 2), -0.385)
    # ... with 4 sequences in the step: -0.77 / 4 = -0.1925
    _close(sequence_mean(loss_B_T, MASK, 4), -0.1925)
    # Dr. GRPO constant: -3.46 / (2 sequences * 4 max tokens) = -0.4325
    _close(constant_normalised_sum(loss_B_T, MASK, 2, max_tokens=4), -0.4325)


# --- GSPO -----------------------------------------------------------------------------------


def test_gspo_loss_and_gradient_by_hand():
    # log ratios: row 0 [0.3, -0.1, 0.1] -> mean 0.1 -> s0 = e^0.1 = 1.1051709
    #             row 1 [0.5, 0.1, (7.0 masked)] -> mean 0.3 -> s1 = e^0.3 = 1.3498588
    # A = [1, 1], eps 0.2/0.2: row 0 unclipped -> -1.1051709; row 1 min(1.3498588, 1.2) -> -1.2
    log_ratio = torch.tensor([[0.3, -0.1, 0.1], [0.5, 0.1, 7.0]])
    old = torch.full((2, 3), -1.0)
    logp = (old + log_ratio).requires_grad_(True)
    pl = gspo_loss(logp, old, torch.tensor([1.0, 1.0]), MASK, eps_low=0.2, eps_high=0.2)
    s0 = math.exp(0.1)
    _close(pl.loss_B_T, [[-s0, -s0, -s0], [-1.2, -1.2, 0.0]])
    _close(pl.ratio_mean, (3 * s0 + 2 * math.exp(0.3)) / 5)
    _close(pl.clip_high_frac, 2 / 5)  # row 1's two tokens
    _close(pl.clip_low_frac, 0.0)
    loss = sequence_mean(pl.loss_B_T, MASK, step_num_sequences=2)
    _close(loss, (-s0 - 1.2) / 2)  # -1.1525855
    loss.backward()
    # row 0: d(-s0)/d logp_t = -s0 / 3 (s0 = exp(mean of 3)), halved by the 2 sequences
    # = -1.1051709 / 6 = -0.1841952 per token; row 1 clipped: 0
    _close(logp.grad, [[-s0 / 6] * 3, [0.0, 0.0, 0.0]])


# --- KL penalty -----------------------------------------------------------------------------


def test_k3_kl_by_hand():
    mask = torch.tensor([[True, True, False]])
    logp = torch.tensor([[-1.0, -2.0, 1e9]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -1e9]])
    kl = k3_kl(logp, ref, mask)
    # d = ref - logp = [-0.5, 1.0]; e^-0.5 + 0.5 - 1 = 0.1065307; e^1 - 1 - 1 = 0.7182818
    _close(kl, [[math.exp(-0.5) - 0.5, math.e - 2.0, 0.0]])
    kl.sum().backward()
    # d/d logp (e^d - d - 1) = 1 - e^d: [1 - 0.6065307, 1 - 2.7182818, 0 under the mask]
    _close(logp.grad, [[1 - math.exp(-0.5), 1 - math.e, 0.0]])


def test_k3_kl_is_zero_when_policy_equals_reference():
    logp = torch.tensor([[-0.3, -2.0]])
    _close(k3_kl(logp, logp.clone(), torch.ones(1, 2, dtype=torch.bool)), [[0.0, 0.0]])


# --- behaviour/proximal mismatch: the decoupled correction -----------------------------------


def test_truncated_importance_weights_by_hand():
    mask = torch.tensor([[True, True, True, False]])
    trainer = torch.tensor([[-1.0, -1.0, -1.0, math.inf]])
    # trainer - sampler = [ln .5, ln 3, 0, (masked)] -> ratios [.5, 3, 1] -> capped at 2: [.5, 2, 1]
    sampler = torch.tensor([[-1.0 - math.log(0.5), -1.0 - math.log(3.0), -1.0, -math.inf]])
    w = truncated_importance_weights(trainer, sampler, mask, cap=2.0)
    _close(w.weight_B_T, [[0.5, 2.0, 1.0, 1.0]])
    _close(w.mean, (0.5 + 2.0 + 1.0) / 3)
    _close(w.capped_frac, 1 / 3)
    assert not w.weight_B_T.requires_grad


def test_mismatch_sequence_mask_by_hand():
    mask = torch.tensor([[True, True], [True, True], [True, True], [False, False], [True, False]])
    sampler = torch.zeros(5, 2)
    trainer = torch.tensor(
        [
            [0.1, -0.1],  # mean 0 -> ratio 1: kept
            [1.0, 0.0],  # mean .5 -> e^.5 = 1.6487 > 1.5: dropped
            [-1.0, -1.0],  # mean -1 -> e^-1 = 0.3679 < 0.5: dropped
            [50.0, 50.0],  # nothing sampled -> ratio 1: kept
            [0.2, math.nan],  # mean 0.2 over the one sampled token -> 1.2214: kept
        ]
    )
    keep = mismatch_sequence_mask(trainer, sampler, mask, low=0.5, high=1.5)
    assert keep.tolist() == [True, False, False, True, True]


def test_mismatch_token_mask_by_hand():
    """IcePop: each token's own ratio pi_proximal / pi_behaviour, both sides bounded; what the caller's mask
    excludes is kept (its own mask decides it), whatever sits there."""
    mask = torch.tensor([[True, True, True, True, False]])
    behaviour = torch.full((1, 5), -2.0)
    # proximal - behaviour = [0, ln 1.9, ln 2.1, ln 0.45, (nan)] -> ratios [1, 1.9, 2.1, 0.45]
    proximal = torch.tensor([[-2.0, -2.0 + math.log(1.9), -2.0 + math.log(2.1), -2.0 + math.log(0.45), math.nan]])
    keep = mismatch_token_mask(proximal, behaviour, mask, low=0.5, high=2.0)
    assert keep.tolist() == [[True, True, False, False, True]]
    # the bounds are inclusive: a ratio of exactly 1 with [1, 1] is kept
    assert mismatch_token_mask(behaviour, behaviour, mask, 1.0, 1.0).tolist() == [[True] * 5]


# --- masking --------------------------------------------------------------------------------

ABSURD = [1e9, -1e9, math.inf, -math.inf, math.nan]


@pytest.mark.parametrize("absurd", ABSURD)
def test_masked_values_change_nothing(absurd):
    """Whatever sits under the mask (in logp, old logp, reference, sampler), loss and gradient
    are those of the clean inputs, and the gradient there is exactly zero."""

    def run(fill):
        logp, old, adv, mask = _ppo_inputs()
        logp = logp.detach().masked_fill(~mask, fill).requires_grad_(True)
        old = old.masked_fill(~mask, -fill if fill == fill else fill)
        ref = (OLD - 0.1).masked_fill(~mask, fill)
        sampler = (OLD + 0.05).masked_fill(~mask, fill)
        total = 0.0
        for variant in (ppo_clip_loss, gspo_loss):
            pl = variant(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
            w = truncated_importance_weights(old, sampler, mask, cap=2.0).weight_B_T
            loss_B_T = pl.loss_B_T * w + 0.1 * k3_kl(logp, ref, mask)
            total = (
                total
                + token_mean(loss_B_T, mask, 5)
                + sequence_mean(loss_B_T, mask, 2)
                + constant_normalised_sum(loss_B_T, mask, 2, 4)
            )
        total.backward()
        keep = mismatch_sequence_mask(old, sampler, mask, 0.5, 1.5)
        return total.detach(), logp.grad, keep

    clean_loss, clean_grad, clean_keep = run(-1.0)
    loss, grad, keep = run(absurd)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(loss, clean_loss, atol=0, rtol=0)
    torch.testing.assert_close(grad, clean_grad, atol=0, rtol=0)
    assert torch.equal(keep, clean_keep)
    assert grad[1, 2].item() == 0.0  # the masked position
    assert (grad[MASK] != 0).sum() >= 3  # and the unclipped sampled ones do get a gradient


def test_all_masked_micro_batch_gives_zero_and_no_nan():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    logp = torch.tensor([[math.nan, math.inf, 1e9]] * 2, requires_grad=True)
    old = torch.tensor([[-math.inf, math.nan, -1e9]] * 2)
    adv = torch.tensor([1.0, -1.0])
    for variant in (ppo_clip_loss, gspo_loss):
        pl = variant(logp, old, adv, mask)
        loss_B_T = pl.loss_B_T + 0.1 * k3_kl(logp, old, mask)
        for loss in (
            token_mean(loss_B_T, mask, 7),
            token_mean(loss_B_T, mask, 0),  # even an empty step
            sequence_mean(loss_B_T, mask, 0),
            constant_normalised_sum(loss_B_T, mask, 0, 8),
        ):
            assert loss.item() == 0.0
            logp.grad = None
            loss.backward(retain_graph=True)
            assert torch.equal(logp.grad, torch.zeros_like(logp))
        for stat in (pl.ratio_mean, pl.approx_kl, pl.clip_frac):
            assert torch.isfinite(stat)
    w = truncated_importance_weights(old, logp.detach(), mask)
    assert torch.isfinite(w.mean) and w.mean.item() == 0.0


# --- micro-batches with the step's normaliser equal the full batch ---------------------------


class _TinyLM(nn.Module):
    def __init__(self, vocab: int = 11, hidden: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab)

    def logp(self, ids_B_T: torch.Tensor) -> torch.Tensor:
        """[b, t] = log p(ids[b, t+1] | ids[b, t]); last column 0 (nothing to predict)."""
        logits = self.head(torch.tanh(self.embed(ids_B_T[:, :-1])))
        lp = torch.log_softmax(logits, -1).gather(-1, ids_B_T[:, 1:, None]).squeeze(-1)
        return torch.cat([lp, torch.zeros_like(lp[:, :1])], dim=1)


def _step_loss(model, ids, mask, old, ref, adv, reduce, variant):
    logp = model.logp(ids)
    pl = variant(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    return reduce(pl.loss_B_T + 0.05 * k3_kl(logp, ref, mask), mask)


@pytest.mark.parametrize("variant", [ppo_clip_loss, gspo_loss])
@pytest.mark.parametrize("reduction", ["token", "sequence", "constant"])
def test_micro_batches_sum_to_full_batch(variant, reduction):
    torch.manual_seed(0)
    ids = torch.randint(0, 11, (4, 6))
    mask = torch.tensor(
        [
            [0, 1, 1, 1, 1, 0],
            [0, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 1, 0],
            [0, 0, 0, 1, 1, 0],
        ],
        dtype=torch.bool,
    )
    model = _TinyLM()
    with torch.no_grad():
        # an "old" policy a little off the current one, so ratios are not all 1
        old = model.logp(ids) + 0.3 * torch.randn(4, 6)
        ref = model.logp(ids) - 0.2
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0])
    step_tokens, step_seqs = int(mask.sum()), 4  # 12 tokens, 4 sequences with sampled tokens

    def reducer(num_tokens, num_seqs):
        return {
            "token": lambda loss, m: token_mean(loss, m, num_tokens),
            "sequence": lambda loss, m: sequence_mean(loss, m, num_seqs),
            "constant": lambda loss, m: constant_normalised_sum(loss, m, num_seqs, max_tokens=6),
        }[reduction]

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    step_reduce = reducer(step_tokens, step_seqs)
    full_loss = _step_loss(model, ids, mask, old, ref, adv, step_reduce, variant)
    full = grads(full_loss)

    model.zero_grad()
    micro_loss = 0.0
    for rows in ([0], [1, 2], [3]):
        loss = _step_loss(
            model, ids[rows], mask[rows], old[rows], ref[rows], adv[rows], step_reduce, variant
        )
        loss.backward()  # gradients accumulate, as in the training loop
        micro_loss += loss.item()
    micro = [p.grad.clone() for p in model.parameters()]
    _close(micro_loss, full_loss.item())
    for g_full, g_micro in zip(full, micro):
        assert g_full.abs().sum() > 0
        torch.testing.assert_close(g_micro, g_full, atol=1e-6, rtol=0)

    # the same split normalised per micro-batch does NOT match: the step's normaliser matters
    model.zero_grad()
    for rows in ([0], [1, 2], [3]):
        local_tokens, local_seqs = int(mask[rows].sum()), len(rows)
        _step_loss(
            model, ids[rows], mask[rows], old[rows], ref[rows], adv[rows],
            reducer(local_tokens, local_seqs), variant,
        ).backward()
    local = [p.grad for p in model.parameters()]
    assert any((gl - gf).abs().max() > 1e-4 for gl, gf in zip(local, full))
