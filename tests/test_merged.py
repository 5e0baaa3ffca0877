"""Merged weights of a LoRA policy (base + scale * B @ A), and the rule `model.sync: auto` decides by."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from agent_rl.learn.logprobs import token_logprobs
from agent_rl.learn.policy import apply_lora
from agent_rl.rollout.weight_sync.choose import prefer_merged
from agent_rl.rollout.weight_sync.merged import merged_state_dict, write_merged


def tiny_lora(tied: bool):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = apply_lora(LlamaForCausalLM(config), rank=4, alpha=12)  # scale 3
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def test_a_merged_linear_is_its_base_plus_scale_b_a():
    model = tiny_lora(tied=True)
    q = model.get_base_model().model.layers[0].self_attn.q_proj
    expected = q.base_layer.weight + 3.0 * q.lora_B["default"].weight @ q.lora_A["default"].weight
    merged = merged_state_dict(model)
    torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.weight"], expected, rtol=0, atol=1e-6)
    assert not any("lora_" in k or "base_layer" in k for k in merged)
    assert "lm_head.weight" not in merged  # tied to the embeddings: written once, as the checkpoint has it


def test_merged_weights_are_the_adapted_model():
    for tied in (True, False):
        model = tiny_lora(tied)
        reference = copy.deepcopy(model).merge_and_unload()
        merged = merged_state_dict(model)
        want = {k: v for k, v in reference.state_dict().items() if not (tied and k == "lm_head.weight")}
        assert merged.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(merged[k], want[k], rtol=0, atol=1e-6)
        # a plain model loaded with them scores like the adapted one
        plain = LlamaForCausalLM(model.get_base_model().config)
        plain.load_state_dict(merged, strict=False)
        if tied:
            plain.tie_weights()
        ids = torch.randint(0, 300, (2, 9))
        with torch.no_grad():
            a = token_logprobs(model, ids, torch.ones_like(ids)).logp_B_T
            b = token_logprobs(plain, ids, torch.ones_like(ids)).logp_B_T
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_the_written_folder_holds_the_merged_weights_and_the_config(tmp_path):
    model = tiny_lora(tied=True)
    write_merged(model, tmp_path)
    back = load_file(str(tmp_path / "model.safetensors"))
    assert back.keys() == merged_state_dict(model).keys()
    assert (tmp_path / "config.json").is_file()


def test_merged_wins_when_the_sampling_it_saves_exceeds_its_push():
    # 22 vs 74 tok/s (this CPU's adapter vs plain figures) on 4096 tokens: 4096 * (1/22 - 1/74) = 130.8 s saved
    merged, saved, push = prefer_merged(22.0, 74.0, 4096, 540_000_000)
    assert merged and abs(saved - 130.83) < 0.01 and abs(push - 1.58) < 1e-9
    # a GPU-like 10% LoRA overhead on a 7B bf16 model (14 GB): 4096 * (1/2700 - 1/3000) = 0.15 s vs 28.5 s
    merged, saved, push = prefer_merged(2700.0, 3000.0, 4096, 14_000_000_000)
    assert not merged and abs(push - 28.5) < 1e-9


async def test_finish_removes_the_versions_folder_when_the_server_is_gone(tmp_path):
    # a run that fails because its server died (the OOM killer) ends with finish(): its merged versions,
    # 2 x 2.5 GB in /dev/shm for a 0.5B model, were left behind when the server refused the pause
    from agent_rl.rollout.serving.vllm.server import free_port
    from agent_rl.rollout.weight_sync.base import WeightSyncError
    from agent_rl.rollout.weight_sync.merged import MergedSync

    sampler = type("Sampler", (), {"urls": [f"http://127.0.0.1:{free_port()}"], "gate": None})()
    model = tiny_lora(tied=False)
    model.get_base_model().config._name_or_path = str(tmp_path / "base")
    sync = MergedSync(tmp_path / "run", sampler, model, timeout_s=5.0, connect_timeout_s=1.0)
    (sync.weights_dir / "v1").mkdir(parents=True)
    try:
        with pytest.raises(WeightSyncError):
            await sync.finish()
        assert not sync.weights_dir.exists()
    finally:
        sync.close()
