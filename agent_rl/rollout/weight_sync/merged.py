"""Merged-weight sampling: a LoRA policy served as plain weights, base + scale * B @ A.

Owns: `merged_state_dict` (the policy's weights with every LoRA delta folded in, under the base
model's checkpoint names), `write_merged` (the folder a reload reads), `ram_folder` (where: /dev/shm when
it has room), and `MergedSync` (each version written there and reloaded in place by every server, as
`FullWeightSync` does; `finish` puts the servers' own base weights back).
Does not own: the reload sequence (`weight_sync.base.Servers.reload_in_place`), deciding between merged
weights and the adapter (`weight_sync.choose`), servers (`rollout.serving`).

Why: vLLM's CPU build samples several times slower through a runtime LoRA adapter than with plain weights
(`bench/rollout.py`'s `adapter_vs_base`: docs/performance.md#the-bench-scripts), and every training rollout uses
the adapter. Pushing merged weights costs a full write and reload per step (SmolLM2-135M fp32: ~0.5 GB; the weight
push row there), which pays when sampling takes tens of seconds a step. On a GPU, where LoRA
kernels cost little and a 7B model's weights are gigabytes, the adapter usually wins: `model.sync: auto`
measures. The trainer keeps training the adapter either way; only what the servers sample from changes.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from agent_rl.rollout.sampler import ServedSampler
from agent_rl.rollout.weight_sync.full import FullWeightSync


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
    """A checkpoint folder a server's reload reads: the merged weights and the model's config."""
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

    def __init__(self, run_dir: str | Path, sampler: ServedSampler, model: Any, **kwargs: Any):
        need = sum(p.numel() * p.element_size() for p in model.get_base_model().parameters())
        super().__init__(run_dir, sampler, write=write_merged, weights_dir=ram_folder(Path(run_dir), need), **kwargs)
        self.base_dir = Path(model.get_base_model().config._name_or_path)

    async def finish(self) -> None:
        """The base weights back on every server (from the model folder), then the versions folder gone
        (also when the reload failed: a RAM-backed folder would outlive the run). A server restarted after it
        serves its own weights: no version is left to restore."""
        try:
            async with self.servers.lock:
                self.versions = []
                await self.servers.reload_in_place(self.base_dir)
        finally:
            self.close()

    def close(self) -> None:
        """Remove the versions folder (a RAM-backed one would outlive the run)."""
        shutil.rmtree(self.weights_dir, ignore_errors=True)
