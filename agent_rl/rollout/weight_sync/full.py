"""Full-weight sync: save the whole model each step, then every server reloads it in place.

Owns: `FullWeightSync`: each version written to `<run_dir>/weights/v{version}` (or where and how a
subclass says: `weight_sync.merged`), reloaded in place by every server (`Servers.reload_in_place`),
older folders deleted; `restore`: a server back in service reloads the newest version.
Does not own: the pause / reload / reset / resume sequence (`weight_sync.base`), the calls themselves and
starting servers that can reload in place (`rollout.serving`), training checkpoints (`runs.checkpoint`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent_rl.rollout.sampler import ServedSampler
from agent_rl.rollout.weight_sync.base import Servers, prune_version_dirs, write_version_dir


def save_pretrained(model: Any, folder: Path) -> None:
    model.save_pretrained(folder, safe_serialization=True)


class FullWeightSync:
    """Full fine-tuning weight sync: save the whole model, then every server reloads it in place.

    The servers must be able to reload their weights in place (`ServingBackend.can_reload`: vLLM 0.32 only
    through its development routes, a server started in dev mode, as a run starts them for full and merged
    weights: `serving.vllm.server`). For each version `push`:
      1. saves the model (`save_pretrained`, safetensors) to `<run_dir>/weights/v{version}`;
      2. the sampler is held, every server pauses (requests in flight are aborted with the tokens they
         have: the sampler keeps them and goes on from them under the new version), reloads the folder,
         resets its prefix cache, the sampler moves to `(served_name, version)`, and the servers
         resume (`Servers.reload_in_place`); no request runs on two versions' weights.
    Folders older than the newest `keep` are deleted (the server reads a folder only while reloading).

    Cost: the whole model crosses the disk each step (fp32 135M: ~0.5 GB), and sampling stops from
    the pause to the resume. On a GPU the server keeps its copy of the weights in GPU memory beside
    the trainer's (plan `VLLMServer.gpu_memory_utilization` for the trainer's weights, gradients and
    optimizer moments); the reload reads the folder through host memory and rebuilds the served
    model layer by layer, so its extra GPU memory is about one layer. For large models a transfer over NCCL
    would avoid the disk (vLLM has routes for it: `serving.vllm.backend`); not implemented here. Where a
    reload in place is not allowed, the honest fallback is a restart: `server.stop()`, set `server.model_dir`
    to the new folder, `server.start()` (a server's start-up each step: docs/performance.md#smaller-measurements).

    A failure resumes every server and leaves the sampler on the previous version. If the reload
    failed on one server after succeeding on another, they now serve different weights: treat the
    error as fatal for the run (restart the servers from the last checkpoint).
    """

    def __init__(self, run_dir: str | Path, sampler: ServedSampler, *, served_name: str = "base", keep: int = 1,
                 timeout_s: float = 600.0, connect_timeout_s: float = 5.0,
                 write: Callable[[Any, Path], None] = save_pretrained, weights_dir: str | Path | None = None):
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (got {keep})")
        # where versions are written and how (merged LoRA weights use their own: `weight_sync.merged`)
        self.weights_dir = Path(weights_dir) if weights_dir is not None else Path(run_dir) / "weights"
        self.write = write
        self.sampler, self.served_name, self.keep = sampler, served_name, keep
        self.servers = Servers(sampler.urls, timeout_s, connect_timeout_s, sampler.gate)
        self.versions: list[int] = []
        self.last_timings: dict[str, float] = {}  # seconds of the last push: save, drain, reload, resume

    async def push(self, model: Any, version: int) -> float:
        """Publish `model`'s full weights as `version` on every server; returns the seconds it took."""
        if self.versions and version <= self.versions[-1]:
            raise ValueError(f"version {version} is not newer than the last pushed ({self.versions[-1]})")
        t0 = time.perf_counter()
        path = await asyncio.to_thread(write_version_dir, self.weights_dir, version, lambda d: self.write(model, d))
        t1 = time.perf_counter()
        async with self.servers.lock:  # a restore waits for the push to end, then reloads this version
            phases = await self.servers.reload_in_place(
                path, lambda: self.sampler.set_policy(self.served_name, version), self.sampler)
            self.versions = [*self.versions, version][-self.keep :]
        t2 = time.perf_counter()
        await asyncio.to_thread(prune_version_dirs, self.weights_dir, set(self.versions))
        t3 = time.perf_counter()
        self.last_timings = {"save_s": t1 - t0, **phases, "resume_s": phases["resume_s"] + t3 - t2}
        return t3 - t0

    async def restore(self, url: str) -> None:
        """The server at `url` is back and takes no request yet: it reloads the newest version in place (nothing
        pushed yet: its own weights are the ones to serve) and drops the blocks its cache holds."""
        async with self.servers.lock, self.servers.session() as http:
            if not self.versions:
                return
            folder = self.weights_dir / f"v{self.versions[-1]}"
            await self.servers.call(url, self.servers.backend.load_weights(http, url, folder))

    async def finish(self) -> None:
        """Nothing to restore: under full fine-tuning the servers keep serving the run's last weights."""
