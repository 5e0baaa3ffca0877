"""Merged-weight sampling: a LoRA policy served as plain weights, base + scale * B @ A.

Owns: `merged_state_dict` (the policy's weights with every LoRA delta folded in, under the base
model's checkpoint names), `MergedSync` (each version written to a RAM-backed folder and reloaded in
place by every server, through `FullWeightSync`'s pause / reload / reset-prefix-cache / resume), and
`choose_sync` (`model.sync: auto`: a short burst with the adapter and one with the plain weights
decide, the choice and its figures logged).
Does not own: the reload protocol (`rollout.weight_sync.FullWeightSync`), servers (`rollout.server`).

Why: vLLM's CPU build samples about 3x slower through a runtime LoRA adapter than with plain weights
(FIELD_NOTES; `bench/rollout.py` measures it), and every training rollout uses the adapter. Pushing
merged weights costs a full write and reload per step (SmolLM2-135M fp32: ~0.5 GB, about a second or
two from /dev/shm), which pays when sampling takes tens of seconds a step. On a GPU, where LoRA
kernels cost little and a 7B model's weights are gigabytes, the adapter usually wins: `auto` measures.
The trainer keeps training the adapter either way; only what the servers sample from changes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import aiohttp
import torch
from safetensors.torch import save_file

from agent_rl.rollout.sampler import SamplingParams, VLLMSampler
from agent_rl.rollout.weight_sync import AdapterSync, FullWeightSync

log = logging.getLogger(__name__)


@torch.no_grad()
def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The policy's weights with each LoRA layer's delta added to its base weight, named as in the base
    checkpoint (`...q_proj.weight`, no `base_layer` or `lora_` entries); tied tensors written once."""
    base = model.get_base_model()
    adapter = model.active_adapter
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        if ".base_layer." in name:
            module_name, _, leaf = name.partition(".base_layer.")
            name = f"{module_name}.{leaf}"
            if leaf == "weight":
                tensor = tensor + base.get_submodule(module_name).get_delta_weight(adapter).to(tensor.dtype)
        if tensor.data_ptr() in seen:  # tied embeddings: the checkpoint holds them once
            continue
        seen.add(tensor.data_ptr())
        out[name] = tensor.detach().to("cpu").contiguous()  # written from host memory
    return out


def write_merged(model: Any, folder: Path) -> None:
    """A checkpoint folder vLLM's reload reads: the merged weights and the model's config."""
    save_file(merged_state_dict(model), str(folder / "model.safetensors"), metadata={"format": "pt"})
    model.get_base_model().config.to_json_file(str(folder / "config.json"))


def ram_folder(run_dir: Path, need_bytes: int) -> Path:
    """A folder in /dev/shm when it has room for two versions (the reload reads a folder once, straight
    from memory), else under the run directory."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2 * need_bytes + (1 << 28):
        return shm / f"agent-rl-{os.getpid()}-{secrets.token_hex(3)}"
    return Path(run_dir) / "merged"


class MergedSync(FullWeightSync):
    """Each version of a LoRA policy as merged weights, reloaded in place (servers in dev mode).

    The servers' base weights are the policy's while the run lasts: `finish` reloads the model folder's
    own weights, so that a shared server (the recipe's, an evaluation after training) serves adapters on
    the true base model again."""

    def __init__(self, run_dir: str | Path, sampler: VLLMSampler, model: Any, **kwargs: Any):
        need = sum(p.numel() * p.element_size() for p in model.get_base_model().parameters())
        super().__init__(run_dir, sampler, write=write_merged, weights_dir=ram_folder(Path(run_dir), need), **kwargs)
        self.base_dir = Path(model.get_base_model().config._name_or_path)

    async def finish(self) -> None:
        """The base weights back on every server (from the model folder), then the versions folder gone,
        also when a server refuses (a dead server: the folder, in RAM, would outlive the run)."""
        try:
            async with aiohttp.ClientSession(timeout=self._http.timeout) as http:
                try:
                    await self._on_all(http, "/pause?mode=wait", "pausing generation")
                    await self._on_all(http, "/collective_rpc", f"reloading the base weights from {self.base_dir}",
                                       {"method": "reload_weights",
                                        "kwargs": {"weights_path": str(self.base_dir.resolve())}})
                    await self._on_all(http, "/reset_prefix_cache", "resetting the prefix cache")
                finally:
                    await self._on_all(http, "/resume", "resuming generation")
        finally:
            self.close()

    def close(self) -> None:
        """Remove the versions folder (a RAM-backed one would outlive the run)."""
        shutil.rmtree(self.weights_dir, ignore_errors=True)


async def burst_tokens_per_s(sampler: VLLMSampler, requests: int = 8, tokens: int = 32) -> float:
    """Sampled tokens per second of `requests` concurrent requests on the sampler's current policy."""
    prompt = list(range(1000, 1256))  # 256 plain tokens: speed depends on lengths, not on content
    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=0)
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(sampler.sample(prompt[i:], params) for i in range(requests)))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def prefer_merged(adapter_tps: float, plain_tps: float, tokens_per_step: int, weight_bytes: int
                  ) -> tuple[bool, float, float]:
    """(merged?, sampling seconds a step saves, seconds a merged push costs): the push is estimated
    at 0.5 GB/s plus 0.5 s of pause and reload (measured on this CPU: 1.2-3.3 s for 0.54 GB)."""
    saved_s = tokens_per_step * (1 / adapter_tps - 1 / plain_tps)
    push_s = weight_bytes / 0.5e9 + 0.5
    return saved_s > push_s, saved_s, push_s


async def choose_sync(run_dir: Path, sampler: VLLMSampler, model: Any, version: int, tokens_per_step: int,
                      adapter_sync: AdapterSync) -> AdapterSync | MergedSync:
    """`model.sync: auto`: the adapter (pushed as `version` already) against the plain served weights,
    which sample as fast as merged ones would; merged weights win when the sampling time they save on a
    step's tokens exceeds the cost of writing and reloading them (`prefer_merged`)."""
    adapter_tps = await burst_tokens_per_s(sampler)
    name = sampler.model
    sampler.set_policy("base", version)
    plain_tps = await burst_tokens_per_s(sampler)
    sampler.set_policy(name, version)
    size = sum(p.numel() * p.element_size() for p in model.get_base_model().parameters())
    merged, saved_s, push_s = prefer_merged(adapter_tps, plain_tps, tokens_per_step, size)
    log.warning("weight sync: %s (burst: adapter %.1f tok/s, plain weights %.1f tok/s; ~%d tokens a step: "
                "%.1f s of sampling saved against ~%.1f s to push %.2f GB of merged weights)",
                "merged" if merged else "adapter", adapter_tps, plain_tps, tokens_per_step, saved_s, push_s, size / 1e9)
    if not merged:
        return adapter_sync
    sync = MergedSync(run_dir, sampler, model)
    await sync.push(model, version)
    await adapter_sync.retire_all()
    return sync


async def _dev_mode(url: str) -> bool:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        try:
            async with http.get(url + "/is_paused") as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False


async def start_weight_sync(cfg: Any, run_dir: Path, sampler: VLLMSampler, model: Any, version: int) -> Any:
    """The sync a run uses, with `model` pushed as `version` (the servers then sample exactly the
    trainer's weights): full weights under full fine-tuning; else as `model.sync` says (adapter,
    merged, or auto: merged where it pays and the servers can reload weights in place)."""
    if cfg.model.full_finetune:
        sync: Any = FullWeightSync(run_dir, sampler)
    elif cfg.model.sync == "merged":
        sync = MergedSync(run_dir, sampler, model)
    else:
        sync = AdapterSync(run_dir, sampler, prefix=f"policy-{os.getpid()}-{secrets.token_hex(3)}")
    await sync.push(model, version)
    if cfg.model.sync != "auto" or cfg.model.full_finetune:
        return sync
    if not all([await _dev_mode(r.url) for r in sampler.replicas]):
        log.warning("weight sync: adapter (model.sync auto: the servers cannot reload weights in place; "
                    "start them with VLLM_SERVER_DEV_MODE=1 to let merged weights compete)")
        return sync
    tokens = cfg.rollout.rollouts_per_step * cfg.rollout.max_tokens_per_turn
    return await choose_sync(run_dir, sampler, model, version, tokens, sync)
