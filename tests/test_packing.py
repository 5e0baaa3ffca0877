"""Shared-prefix packing (`learn.packing`): the layout by hand, the same log-probs, entropies and
gradients as padded rows (float64, tiny random Llama with LoRA), micro-batches by packed tokens, and
which models may use it."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen3Config
from transformers.models.llama import modeling_llama

from agent_rl.demos import Demo
from agent_rl.learn.batching import collate, micro_batches
from agent_rl.learn.logprobs import token_logprobs
from agent_rl.learn.packing import pack_rows, supports_packing
from agent_rl.learn.policy import apply_lora, trainable_parameters

VOCAB = 96


def _padded(rows):
    T = max(map(len, rows))
    ids = torch.zeros((len(rows), T), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r)
        attn[b, :len(r)] = 1
    return ids, attn


def test_layout_by_hand():
    ids, attn = _padded([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4, 6], [7, 8]])
    p = pack_rows(ids, attn)
    # lexicographic order: [1 2 3 4], [1 2 3 4 6] (shares 4), [1 2 5] (shares 2), [7 8] (shares 0)
    assert p.input_ids_1_P.tolist() == [[1, 2, 3, 4, 6, 5, 7, 8]]
    assert p.position_ids_1_P.tolist() == [[0, 1, 2, 3, 4, 2, 0, 1]]
    assert p.slot_B_T.tolist() == [[0, 1, 2, 3, -1], [0, 1, 5, -1, -1], [0, 1, 2, 3, 4], [6, 7, -1, -1, -1]]
    attends = [set(torch.nonzero(row).flatten().tolist()) for row in p.attend_P_P]
    assert attends == [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}, {0, 1, 2, 3, 4}, {0, 1, 5}, {6}, {6, 7}]
    eager = p.attention_mask("eager", torch.float32)
    assert eager.shape == (1, 1, 8, 8) and eager[0, 0, 5, 1] == 0 and \
        eager[0, 0, 5, 2] == torch.finfo(torch.float32).min


def _rotary_in_float64(model):
    """Hugging Face computes rotary cos/sin in float32 whatever the model's dtype; its vectorised cos
    rounds an element differently depending on the tensor's length (1 ulp), which packed and padded
    batches differ in. In float64 the comparison below can be exact."""
    rotary = model.get_base_model().model.rotary_emb

    def forward(x, position_ids):
        freqs = position_ids[..., None].double() * rotary.inv_freq.double()
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * rotary.attention_scaling).to(x.dtype), (emb.sin() * rotary.attention_scaling).to(x.dtype)

    rotary.forward = forward
    return model


def _tiny_lora(attn_implementation="sdpa"):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn_implementation)
    model = apply_lora(LlamaForCausalLM(config).requires_grad_(False), rank=4, alpha=8).double()
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "lora_B" in name:
                prm.normal_(0.0, 0.5)
    return _rotary_in_float64(model)


def _group_rows():
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, VOCAB, (9,), generator=g).tolist()
    other = prompt[:4] + torch.randint(1, VOCAB, (6,), generator=g).tolist()  # shares the "system prompt" only
    rows = [prompt + torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in (5, 2, 7)]
    return rows + [list(rows[1]), prompt[:6], other + [5, 6, 7]]  # a duplicate, a row that is another's prefix


def _eager_in_float64(query_dtype_attention):
    """Hugging Face's eager attention, with the softmax in the model's dtype (it always takes float32)."""

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        key = modeling_llama.repeat_kv(key, module.num_key_value_groups)
        value = modeling_llama.repeat_kv(value, module.num_key_value_groups)
        weights = torch.softmax(torch.matmul(query, key.transpose(2, 3)) * scaling + attention_mask, dim=-1)
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights

    return attention


def _packed_and_padded(model):
    ids, attn = _padded(_group_rows())
    picked = torch.rand(ids.shape, generator=torch.Generator().manual_seed(4)) < 0.6
    picked &= torch.cat([attn[:, 1:].bool(), torch.zeros((ids.shape[0], 1), dtype=torch.bool)], dim=1)
    assert pack_rows(ids, attn).input_ids_1_P.shape[1] < int(attn.sum())  # something is shared
    results = []
    for share in (False, True):
        model.zero_grad()
        out = token_logprobs(model, ids, attn, chunk_size=5, positions_B_T=picked, share_prefixes=share)
        (out.logp_B_T * torch.linspace(0.5, 1.5, ids.shape[1], dtype=torch.float64)).sum().backward()
        results.append((out.logp_B_T.detach(), out.entropy_B_T,
                        [prm.grad.clone() for prm in trainable_parameters(model)]))
    assert (results[0][0][picked] != 0).all() and (results[0][0][~picked] == 0).all()
    assert all(g.abs().sum() > 0 for g in results[0][2])
    return results


def _rms_norm_in_float64(self, hidden):
    """Hugging Face's RMSNorm, without its round trip through float32."""
    return self.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def test_packed_equals_padded_in_values_entropies_and_gradients(monkeypatch):
    """Exact in float64 once no step rounds to float32: Hugging Face's eager softmax and RMSNorm do, and
    a shared token's gradient is the sum over its rows before such a step (padded: after), so they are
    swapped for float64 ones here."""
    monkeypatch.setattr(modeling_llama, "eager_attention_forward", _eager_in_float64(torch.float64))
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _rms_norm_in_float64)
    (logp_a, ent_a, grads_a), (logp_b, ent_b, grads_b) = _packed_and_padded(_tiny_lora("eager"))
    torch.testing.assert_close(logp_b, logp_a, atol=1e-12, rtol=0)
    torch.testing.assert_close(ent_b, ent_a, atol=1e-12, rtol=0)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(gb, ga, atol=1e-10, rtol=0)


def test_packed_equals_padded_with_sdpa_to_float32_rounding():
    """What training runs (sdpa, Hugging Face's RMSNorm): float32 steps round a shared token's summed
    gradient differently from its rows' separate ones, so agreement is to ~1e-6 (a wrong mask or
    position would be off by ~1)."""
    (logp_a, ent_a, grads_a), (logp_b, ent_b, grads_b) = _packed_and_padded(_tiny_lora("sdpa"))
    torch.testing.assert_close(logp_b, logp_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_b, ent_a, atol=1e-5, rtol=0)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(gb, ga, atol=1e-5, rtol=1e-3)


def test_packed_without_positions_scores_every_real_token():
    model = _tiny_lora()
    ids, attn = _padded(_group_rows())
    with torch.no_grad():
        padded = token_logprobs(model, ids, attn).logp_B_T
        packed = token_logprobs(model, ids, attn, share_prefixes=True).logp_B_T
    real = torch.cat([attn[:, 1:].bool(), torch.zeros((ids.shape[0], 1), dtype=torch.bool)], dim=1)
    torch.testing.assert_close(packed[real], padded[real], atol=1e-12, rtol=0)
    assert (packed[~real] == 0).all()


def test_micro_batches_count_packed_tokens_and_keep_prefixes_together():
    prompt_a, prompt_b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9]
    rows = [prompt_a + [10, 11], prompt_b + [12], prompt_a + [13, 14], prompt_b + [15, 16]]
    demos = [Demo(str(i), tuple(r), (0,) * 6 + (1,) * (len(r) - 6)) for i, r in enumerate(rows)]
    batch = collate(demos, [0.0] * 4)
    # prefix order: a+[10 11] (8), a+[13 14] (+2), b+[12] (+4: shares [1 2 3]), b+[15 16] (+2) = 16 packed
    assert [mb.input_ids_B_T[:, :8].tolist() for mb in micro_batches(batch, max_tokens=16, share_prefixes=True)] == [
        [rows[0], rows[2], rows[1] + [0], rows[3]]]
    # padded, the same budget holds two rows of 8 at a time
    assert len(micro_batches(batch, max_tokens=16)) == 2
    # 12 packed tokens: a's two rows (10), then b's (7 + 2 = 9); a row longer than the budget goes alone
    assert [mb.index_B.tolist() for mb in micro_batches(batch, max_tokens=12, share_prefixes=True)] == [[0, 2], [1, 3]]
    assert [mb.index_B.tolist() for mb in micro_batches(batch, max_tokens=4, share_prefixes=True)] == \
        [[0], [2], [1], [3]]
    assert [mb.index_B.tolist() for mb in micro_batches(batch, max_sequences=3, share_prefixes=True)] == \
        [[0, 2, 1], [3]]


def test_which_models_can_run_packed():
    llama = LlamaConfig(num_hidden_layers=1)
    llama._attn_implementation = "sdpa"
    assert supports_packing(llama)
    llama._attn_implementation = "flash_attention_2"  # takes no (query, key) mask
    assert not supports_packing(llama)
    mistral = MistralConfig(sliding_window=4096, num_hidden_layers=1)
    mistral._attn_implementation = "sdpa"
    assert not supports_packing(mistral)  # the custom mask would drop the window
    qwen = Qwen3Config(num_hidden_layers=2, use_sliding_window=False)
    qwen._attn_implementation = "sdpa"
    assert supports_packing(qwen)
    with pytest.raises(ValueError, match="share_prefixes"):
        model = _tiny_lora()
        model.get_base_model().config._attn_implementation = "flash_attention_2"
        ids, attn = _padded([[1, 2, 3]])
        token_logprobs(model, ids, attn, share_prefixes=True)
