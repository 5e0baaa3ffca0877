"""bench/gpu_trainer.py's stand-ins for what a lent GPU lacks, checked on the CPU: the in-process sampler batches
requests that arrive together and reports each sampled token's log-prob as the trainer computes it; a random
model is made to end its turns at the share asked; the weight sync copies the trainer's adapter into the
sampler's copy and tags what follows with the new version. And bench/gpu_check.py, where its machine lacks what it
needs, says which in one line."""

from __future__ import annotations

import asyncio
import copy
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from agent_rl.learn.logprobs import token_logprobs
from agent_rl.learn.policy import apply_lora, load_causal_lm
from agent_rl.rollout.sampler import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is not installed: the checkout's

from bench.gpu_trainer import CopySync, HFSampler, ends_turns


async def test_requests_arriving_together_are_one_batch_and_their_logprobs_are_the_trainers(tiny_dir, renderer):
    model = load_causal_lm(str(tiny_dir)).eval()
    sampler = HFSampler(model, renderer)
    prompts = [renderer.render([]) + renderer.encode(text) for text in ("Hi", "What is six times seven?", "2 + 2")]
    limits = [5, 9, 7]
    got = await asyncio.gather(*(sampler.sample(p, SamplingParams(max_tokens=n, seed=3)) for p, n in zip(prompts,
                                                                                                       limits)))
    assert sampler.batches == 1
    for prompt, limit, c in zip(prompts, limits, got):
        assert 0 < len(c.token_ids) <= limit and len(c.logprobs) == len(c.token_ids)
        ended = c.token_ids[-1] in renderer.stop_token_ids
        assert c.finish_reason == ("stop" if ended else "length") and (ended or len(c.token_ids) == limit)
        x = torch.tensor([[*prompt, *c.token_ids]])
        with torch.no_grad():
            ours = token_logprobs(model, x, torch.ones_like(x)).logp_B_T[0, len(prompt) - 1: -1]
        assert torch.allclose(torch.tensor(c.logprobs), ours, atol=1e-4), (c.logprobs, ours.tolist())


def test_a_random_model_is_made_to_end_its_turns_at_the_share_asked(tiny_dir, renderer):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(tiny_dir)))
    stop = renderer.stop_token_ids[0]

    def p_stop() -> float:
        with torch.no_grad():
            return model(torch.randint(0, 1000, (4, 32))).logits.softmax(-1)[..., stop].mean().item()

    before = p_stop()
    assert before < 0.01  # one token of a ~49k vocabulary
    assert abs(ends_turns(model, stop, p_stop=0.08) - 0.08) < 1e-3  # on its own probe
    assert 0.04 < p_stop() < 0.16  # on a fresh one
    column = model.get_input_embeddings().weight[:, 0]
    assert torch.all(column[torch.arange(len(column)) != stop] == 0.1)  # every token's but the stop's (tied rows)


async def test_a_push_copies_the_adapter_into_the_sampler_and_tags_what_follows(tiny_dir, renderer):
    policy = apply_lora(load_causal_lm(str(tiny_dir)), rank=4)
    sampler = HFSampler(copy.deepcopy(policy), renderer)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(1.0)  # the update the trainer made
    assert await CopySync(sampler).push(policy, 3) >= 0 and sampler.policy_version == 3
    theirs = dict(sampler.model.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in policy.named_parameters() if "lora_" in n)
    c = await sampler.sample(renderer.render([]) + renderer.encode("Hi"), SamplingParams(max_tokens=3))
    assert c.policy_version == 3 and set(c.versions) == {3}


def test_gpu_check_says_in_one_line_what_is_missing(monkeypatch, capsys):
    import importlib.util

    from bench import gpu_check

    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["gpu_check.py"])
    assert gpu_check.main() == 1
    assert capsys.readouterr().out.splitlines()[0] == \
        "FAIL: torch sees no CUDA device (torch.cuda.is_available() is False)"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    monkeypatch.setattr("sys.argv", ["gpu_check.py", "--allow-cpu"])
    assert gpu_check.main() == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("FAIL: vLLM is not installed") and "bench/gpu_trainer.py" in first
