"""Which weight sync a run uses: the factory the trainer calls, and `model.sync: auto`'s measured choice.

Owns: `start_weight_sync` (full weights under full fine-tuning; else the adapter, merged weights, or
`auto`), `choose_sync` (`auto`: a short burst with the adapter and one with the plain served weights
decide, the choice and its figures logged), and the rule it decides by (`prefer_merged`).
Does not own: how each sync pushes (`weight_sync.adapter`, `full`, `merged`), servers and whether they can reload
in place (`rollout.serving`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

import aiohttp

from agent_rl.core.config import ModelConfig, RolloutConfig
from agent_rl.rollout.sampler import Sampler, SamplingParams, ServedSampler
from agent_rl.rollout.serving.choose import serving_backend
from agent_rl.rollout.weight_sync.adapter import AdapterSync
from agent_rl.rollout.weight_sync.base import WeightSync
from agent_rl.rollout.weight_sync.full import FullWeightSync
from agent_rl.rollout.weight_sync.merged import MergedSync

log = logging.getLogger(__name__)


async def start_weight_sync(model_cfg: ModelConfig, rollout: RolloutConfig, max_staleness: int, run_dir: Path,
                            sampler: ServedSampler, model: Any, version: int) -> WeightSync:
    """The sync a run uses, with `model` pushed as `version` (the servers then sample exactly the
    trainer's weights): full weights under full fine-tuning; else as `model.sync` says (adapter,
    merged, or auto: merged where it pays and the servers can reload weights in place). An adapter sync
    keeps the newest `max_staleness` + 1 versions loaded (the versions a trained token may come from)."""
    sync: AdapterSync | FullWeightSync
    if model_cfg.full_finetune:
        sync = FullWeightSync(run_dir, sampler)
    elif model_cfg.sync == "merged":
        sync = MergedSync(run_dir, sampler, model)
    else:
        sync = AdapterSync(run_dir, sampler, keep=max_staleness + 1,
                           prefix=f"policy-{os.getpid()}-{secrets.token_hex(3)}")
    await sync.push(model, version)
    if model_cfg.sync != "auto" or not isinstance(sync, AdapterSync):  # full fine-tuning: full weights
        return sync
    if not all([await _can_reload(url) for url in sampler.urls]):
        log.warning("weight sync: adapter (model.sync auto: the servers cannot reload weights in place; "
                    "start them with VLLM_SERVER_DEV_MODE=1 to let merged weights compete)")
        return sync
    tokens = rollout.rollouts_per_step * rollout.max_tokens_per_turn
    return await choose_sync(run_dir, sampler, model, version, tokens, sync)


async def choose_sync(run_dir: Path, sampler: ServedSampler, model: Any, version: int, tokens_per_step: int,
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


def prefer_merged(adapter_tps: float, plain_tps: float, tokens_per_step: int, weight_bytes: int
                  ) -> tuple[bool, float, float]:
    """(merged?, sampling seconds a step saves, seconds a merged push costs): the push is estimated
    at 0.5 GB/s plus 0.5 s of pause and reload (what it measured: docs/performance.md#smaller-measurements)."""
    saved_s = tokens_per_step * (1 / adapter_tps - 1 / plain_tps)
    push_s = weight_bytes / 0.5e9 + 0.5
    return saved_s > push_s, saved_s, push_s


async def burst_tokens_per_s(sampler: Sampler, requests: int = 8, tokens: int = 32) -> float:
    """Sampled tokens per second of `requests` concurrent requests on the sampler's current policy."""
    prompt = list(range(1000, 1256))  # 256 plain tokens: speed depends on lengths, not on content
    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=0)
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(sampler.sample(prompt[i:], params) for i in range(requests)))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


async def _can_reload(url: str) -> bool:
    """Whether the server at `url` can reload weights in place (vLLM: its development routes, in dev mode)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        return await serving_backend().can_reload(http, url)
