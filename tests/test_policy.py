"""Chunked log-probs, temperature, the LoRA reference and trainability, on a tiny random Llama."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agent_rl.learn.batching import Batch
from agent_rl.learn.logprobs import Scoring, token_logprobs
from agent_rl.learn.policy import apply_lora, enable_full_finetune, trainable_parameters
from agent_rl.learn.reference import BaseWeights

VOCAB = 49152  # SmolLM2's vocabulary: the size chunking exists for


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    model.requires_grad_(False)
    return model


def _lora(model):
    peft_model = apply_lora(model, rank=4, alpha=8)
    # peft starts lora_B at zero (adapter = identity); make it do something so tests can fail
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    return peft_model


def _inputs():
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    attn = torch.ones_like(ids)
    attn[1, 6:] = 0  # row 1: 6 real tokens, right-padded
    ids[1, 6:] = 0
    return ids, attn


def _unchunked(model, ids, attn, temperature):
    """The obvious way: full logits, / temperature, log_softmax, take token t+1 at position t."""
    logits = model(input_ids=ids, attention_mask=attn).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)[:, :-1]
    return logp, entropy


@pytest.fixture(scope="module")
def base():
    return _tiny_llama()


@pytest.mark.parametrize("chunk_size", [1, 3, 8, 100])
def test_chunked_equals_unchunked(base, chunk_size):
    ids, attn = _inputs()
    with torch.no_grad():
        out = token_logprobs(base, ids, attn, temperature=1.0, chunk_size=chunk_size)
        logp, entropy = _unchunked(base, ids, attn, 1.0)
    real = attn[:, 1:].bool()  # positions whose next token is a real token
    assert out.logp_B_T.shape == (2, 9)
    torch.testing.assert_close(out.logp_B_T[:, :-1][real], logp[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy_B_T[:, :-1][real], entropy[real], atol=1e-5, rtol=0)
    assert out.logp_B_T[:, -1].tolist() == [0.0, 0.0]  # nothing after the last position
    assert (out.logp_B_T[:, :-1][real] < 0).all()


def test_entropy_is_a_statistic_outside_the_graph():
    """With gradients on, the log-probs carry them and the entropy does not (in the graph, each
    checkpointed chunk's vocabulary-wide exp and product were rebuilt in the backward pass and kept,
    unused, until it ended: +1.3 GB at the peak of a 4,096-token SmolLM2 micro-batch). Same values."""
    model = _lora(_tiny_llama())
    ids, attn = _inputs()
    out = token_logprobs(model, ids, attn, temperature=1.0, chunk_size=4)
    assert out.logp_B_T.requires_grad and not out.entropy_B_T.requires_grad
    with torch.no_grad():
        logp, entropy = _unchunked(model, ids, attn, 1.0)
    real = attn[:, 1:].bool()
    torch.testing.assert_close(out.entropy_B_T[:, :-1][real], entropy[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.logp_B_T.detach()[:, :-1][real], logp[real], atol=1e-5, rtol=0)


def test_temperature_divides_logits(base):
    ids, attn = _inputs()
    with torch.no_grad():
        hot = token_logprobs(base, ids, attn, temperature=0.5, chunk_size=4)
        cold = token_logprobs(base, ids, attn, temperature=1.0, chunk_size=4)
        logp, entropy = _unchunked(base, ids, attn, 0.5)
    torch.testing.assert_close(hot.logp_B_T[0, :-1], logp[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(hot.entropy_B_T[0, :-1], entropy[0], atol=1e-5, rtol=0)
    # sharper distribution at 0.5: lower entropy everywhere than at temperature 1
    assert (hot.entropy_B_T[0, :-1] < cold.entropy_B_T[0, :-1]).all()
    with pytest.raises(ValueError):
        token_logprobs(base, ids, attn, temperature=0.0)


def test_reference_is_the_base_model_with_adapter_disabled():
    model = _tiny_llama()
    untouched = copy.deepcopy(model)
    peft_model = _lora(model)
    ids, attn = _inputs()
    with torch.no_grad():
        base_logp = token_logprobs(untouched, ids, attn, chunk_size=4).logp_B_T
        adapted = token_logprobs(peft_model, ids, attn, chunk_size=4).logp_B_T
    # every real token after the first is scored as if sampled
    every = Batch(ids, attn, torch.cat([attn[:, 1:], torch.zeros_like(attn[:, :1])], dim=1).bool(),
                  torch.zeros(ids.shape), torch.zeros(2), step_num_tokens=13, step_num_sequences=2)
    ref = BaseWeights(peft_model).logprobs(every, Scoring(chunk_size=4))
    assert (adapted - base_logp).abs().max() > 1e-3  # the adapter does change the policy
    torch.testing.assert_close(ref, torch.where(every.loss_mask_B_T, base_logp, 0.0), atol=1e-6, rtol=0)
    assert not ref.requires_grad
    # and the adapter is back on afterwards
    with torch.no_grad():
        again = token_logprobs(peft_model, ids, attn, chunk_size=4).logp_B_T
    torch.testing.assert_close(again, adapted, atol=1e-6, rtol=0)


def test_only_lora_parameters_are_trainable_and_get_gradients():
    peft_model = _lora(_tiny_llama())
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    # 7 linear projections (q k v o gate up down) x 2 layers x (lora_A, lora_B); no lm_head
    assert len(trainable) == 28
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable_parameters(peft_model)) == 28

    ids, attn = _inputs()
    out = token_logprobs(peft_model, ids, attn, chunk_size=3)
    mask = attn[:, 1:].bool()
    out.logp_B_T[:, :-1][mask].sum().backward()
    for name, p in peft_model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


def test_chunked_gradient_equals_unchunked_gradient():
    """Checkpointed chunks recompute the logits in backward; the gradient must not change.
    In float64, so that summation order (chunked or not) is far below the tolerance."""
    peft_model = _lora(_tiny_llama()).double()
    ids, attn = _inputs()
    mask = attn[:, 1:].bool()
    params = trainable_parameters(peft_model)

    token_logprobs(peft_model, ids, attn, chunk_size=3).logp_B_T[:, :-1][mask].sum().backward()
    chunked = [p.grad.clone() for p in params]
    peft_model.zero_grad()
    _unchunked(peft_model, ids, attn, 1.0)[0][mask].sum().backward()
    for g_chunked, p in zip(chunked, params):
        assert g_chunked.abs().sum() > 0
        torch.testing.assert_close(g_chunked, p.grad, atol=1e-10, rtol=0)


def test_full_finetune_trains_everything():
    model = enable_full_finetune(_tiny_llama())
    assert all(p.requires_grad for p in model.parameters())
    ids, attn = _inputs()
    token_logprobs(model, ids, attn, chunk_size=4).logp_B_T.sum().backward()
    assert model.get_output_embeddings().weight.grad.abs().sum() > 0


def test_no_vocabulary_wide_activation_is_kept_for_backward():
    """Chunking only saves memory if autograd does not keep each chunk's logits until backward:
    count what the forward pass saves for backward."""
    peft_model = _lora(_tiny_llama())
    ids, attn = _inputs()
    saved_vocab_wide = []

    def pack(t):
        if t.dim() >= 3 and t.shape[-1] == VOCAB:  # a [B, C, V] activation, not the [V, H] weight
            saved_vocab_wide.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = token_logprobs(peft_model, ids, attn, chunk_size=3)
    assert saved_vocab_wide == []
    out.logp_B_T.sum().backward()  # recomputed chunk by chunk, and still correct (test above)

    # the same forward with the model's own full logits does keep them: the check can fail
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _unchunked(peft_model, ids, attn, 1.0)
    assert sum(saved_vocab_wide) >= 2 * 8 * VOCAB


def test_load_causal_lm_from_a_folder(tmp_path):
    from agent_rl.learn.policy import load_causal_lm

    model = _tiny_llama()
    model.save_pretrained(tmp_path)
    loaded = load_causal_lm(str(tmp_path))
    assert not any(p.requires_grad for p in loaded.parameters())  # frozen until made trainable
    ids, attn = _inputs()
    with torch.no_grad():
        expected = token_logprobs(model, ids, attn).logp_B_T
        actual = token_logprobs(loaded, ids, attn).logp_B_T
    torch.testing.assert_close(actual, expected, atol=0, rtol=0)


def test_selected_positions_match_every_position_in_values_and_gradients():
    """`positions_B_T` (the loss mask) computes the output layer only there: same log-probs,
    entropies and gradients at those columns as the full computation, 0.0 elsewhere. float64."""
    peft_model = _lora(_tiny_llama()).double()
    ids, attn = _inputs()
    picked = torch.zeros_like(ids, dtype=torch.bool)
    picked[0, [1, 2, 5, 8]] = True  # column 8 is the last: it predicts nothing, so it stays 0.0
    picked[1, [0, 4, 7]] = True  # column 7 is padding of row 1 (a caller's mask never picks it; still exact)
    params = trainable_parameters(peft_model)

    full = token_logprobs(peft_model, ids, attn, chunk_size=3)
    torch.where(picked, full.logp_B_T, 0.0).sum().backward()
    full_grads = [p.grad.clone() for p in params]
    peft_model.zero_grad()
    some = token_logprobs(peft_model, ids, attn, chunk_size=2, positions_B_T=picked)
    some.logp_B_T.sum().backward()

    scored = picked.clone()
    scored[:, -1] = False
    for name in ("logp_B_T", "entropy_B_T"):
        ours, theirs = getattr(some, name), getattr(full, name).detach()
        torch.testing.assert_close(ours[scored], theirs[scored], atol=1e-12, rtol=0)
        assert (ours[~scored] == 0).all() and (ours[scored] != 0).all(), name
    assert not some.entropy_B_T.requires_grad
    for g_full, p in zip(full_grads, params):
        assert g_full.abs().sum() > 0
        torch.testing.assert_close(p.grad, g_full, atol=1e-10, rtol=0)


def test_no_selected_position_still_runs_backward_through_every_layer():
    """A data-parallel rank whose rows have no sampled token must run the same backward as the
    others (FSDP's hooks fire per layer): its log-probs are all 0.0 and its gradients exist, all 0."""
    peft_model = _lora(_tiny_llama())
    ids, attn = _inputs()
    out = token_logprobs(peft_model, ids, attn, positions_B_T=torch.zeros_like(ids, dtype=torch.bool))
    assert (out.logp_B_T == 0).all() and (out.entropy_B_T == 0).all()
    out.logp_B_T.sum().backward()
    grads = [p.grad for p in trainable_parameters(peft_model)]
    assert all(g is not None for g in grads) and all((g == 0).all() for g in grads)
    with pytest.raises(ValueError, match="positions_B_T has shape"):
        token_logprobs(peft_model, ids, attn, positions_B_T=torch.ones(2, 3, dtype=torch.bool))


def test_backward_recomputes_the_log_probs_but_not_the_entropy(monkeypatch):
    """Each checkpointed chunk runs again in the backward pass; its vocabulary-wide entropy (no gradient)
    must not: count the exp calls over vocabulary-wide tensors, forward and backward."""
    peft_model = _lora(_tiny_llama())
    ids, attn = _inputs()
    calls = []
    real_exp = torch.Tensor.exp

    def counting_exp(t):
        if t.shape[-1] == VOCAB:
            calls.append(t.shape)
        return real_exp(t)

    monkeypatch.setattr(torch.Tensor, "exp", counting_exp)
    out = token_logprobs(peft_model, ids, attn, chunk_size=6)  # 3 positions x 2 rows a chunk: 8 positions, 3 chunks
    assert len(calls) == 3
    out.logp_B_T.sum().backward()
    assert len(calls) == 3  # the backward pass recomputed log-probs only
    assert all(p.grad is not None for p in trainable_parameters(peft_model))
