"""Weight sync: after each optimizer step, make every vLLM server sample from the new policy.

Owns: writing each policy version to disk (`<run_dir>/adapters/v{version}` for LoRA,
`<run_dir>/weights/v{version}` for full fine-tuning; temp folder then rename), loading it on every
server URL of the sampler, retiring old versions on the servers and on disk, and pointing the
sampler at the new version so every later rollout carries the version it was sampled with.
Does not own: starting servers (`rollout.server`), sampling (`rollout.sampler`), training checkpoints
(`runs.checkpoint`).

Two classes, one per way of training:
- `AdapterSync` (LoRA): each version is a new adapter name, `{prefix}-v{version}`, loaded next to
  the previous ones. A name is never reloaded with new weights: vLLM keys its prefix cache on the
  adapter's (name, path), so a reload would serve KV blocks computed with the old weights.
  The newest `keep` versions stay loaded, so requests still running on the previous version finish.
- `FullWeightSync` (full fine-tuning): the served weights are replaced in place through vLLM's
  development endpoints; one version at a time, so in-flight requests are drained first.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from agent_rl.core.files import atomic_dir
from agent_rl.rollout.sampler import VLLMSampler


class WeightSyncError(Exception):
    """A server did not take the new weights; the message names the server and quotes its reply."""


_VERSION_DIR = re.compile(r"^v(\d+)$")


def _write_version_dir(parent: Path, version: int, write: Callable[[Path], None]) -> Path:
    """`write(folder)` into `parent/v{version}`, atomically (`core.files.atomic_dir`): a version folder
    exists only once complete; one of the same version (a resumed run writing it again) is replaced."""
    final = parent / f"v{version}"
    with atomic_dir(final) as tmp:
        write(tmp)
    return final


def _prune_version_dirs(parent: Path, keep_versions: set[int]) -> None:
    """Delete every `v{n}` folder not in `keep_versions` (older versions, or a crashed run's)."""
    if not parent.is_dir():
        return
    for path in parent.iterdir():
        m = _VERSION_DIR.match(path.name)
        if m and int(m.group(1)) not in keep_versions:
            shutil.rmtree(path, ignore_errors=True)


class _Http:
    """POST helper: every call has a deadline; every error names the server and quotes its reply."""

    def __init__(self, timeout_s: float, connect_timeout_s: float):
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)

    async def post(self, http: aiohttp.ClientSession, url: str, path: str, what: str,
                   body: dict[str, Any] | None = None, ok: tuple[int, ...] = ()) -> int:
        try:
            async with http.post(url + path, json=body if body is not None else {}) as resp:
                status, text = resp.status, await resp.text()
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise WeightSyncError(f"vLLM server {url} did not answer POST {path} ({what}): "
                                  f"{type(e).__name__}: {e or 'timed out'}") from None
        if status >= 400 and status not in ok:
            hint = ""
            if status == 404 and "Not Found" in text[:40]:
                hint = (" (the endpoint does not exist: LoRA loading needs "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, in-place reloading VLLM_SERVER_DEV_MODE=1)")
            raise WeightSyncError(f"vLLM server {url} refused {what} (HTTP {status}): {text[:500]!r}{hint}")
        return status


class AdapterSync:
    """LoRA weight sync: each optimizer step becomes a new adapter version on every server.

        sync = AdapterSync(run_dir, sampler)
        await sync.load_initial(sft_adapter_dir)      # optional: version 0
        seconds = await sync.push(peft_model, step)   # after each optimizer step

    `push` saves the adapter (peft `save_pretrained`, safetensors) to `<run_dir>/adapters/v{version}`,
    loads it as `{prefix}-v{version}` on every server URL of the sampler (concurrently), calls
    `sampler.set_policy(name, version)`, then unloads all but the newest `keep` versions from the
    servers and deletes their folders. Without `load_initial` the sampler stays on the base model,
    which is version 0 of a fresh LoRA (peft initialises B = 0).

    Versions must increase. A server that still holds `{prefix}-v{n}` from an earlier process
    refuses to load it again (we never reload a name with other weights): after a resume on a
    long-lived server, pass a `prefix` unique to the run. Requests still running on an unloaded
    version finish (they hold their adapter), but a retry of one would be refused: keep `keep`
    above the number of versions that rollouts may lag behind.
    """

    def __init__(self, run_dir: str | Path, sampler: VLLMSampler, *, keep: int = 2, prefix: str = "policy",
                 timeout_s: float = 120.0, connect_timeout_s: float = 5.0):
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (got {keep})")
        self.adapters_dir = Path(run_dir) / "adapters"
        self.sampler, self.keep, self.prefix = sampler, keep, prefix
        self.urls = [r.url for r in sampler.replicas]
        self._http = _Http(timeout_s, connect_timeout_s)
        self.loaded: list[int] = []  # versions loaded on every server, oldest first
        self.last_timings: dict[str, float] = {}  # seconds of the last push: save, load, retire

    def name(self, version: int) -> str:
        return f"{self.prefix}-v{version}"

    async def push(self, model: Any, version: int) -> float:
        """Publish `model`'s adapter as `version` on every server; returns the seconds it took."""
        return await self._publish(lambda d: model.save_pretrained(d, safe_serialization=True), version)

    async def load_initial(self, source: Any) -> float:
        """Publish a starting adapter (a peft model, or a folder saved by peft, e.g. from SFT) as version 0."""
        if isinstance(source, (str, Path)):
            src = Path(source)
            if not (src / "adapter_config.json").is_file():
                raise WeightSyncError(f"{str(src)!r} is not a peft adapter folder (no adapter_config.json)")
            return await self._publish(lambda d: shutil.copytree(src, d, dirs_exist_ok=True), 0)
        return await self.push(source, 0)

    async def _publish(self, write: Callable[[Path], None], version: int) -> float:
        if self.loaded and version <= self.loaded[-1]:
            raise ValueError(f"version {version} is not newer than the last pushed ({self.loaded[-1]}): "
                             f"adapter names are never reused")
        t0 = time.perf_counter()
        # in a thread: rollouts sharing this event loop keep streaming while the file is written
        path = await asyncio.to_thread(_write_version_dir, self.adapters_dir, version, write)
        t1 = time.perf_counter()
        name = self.name(version)
        async with aiohttp.ClientSession(timeout=self._http.timeout) as http:
            results = await asyncio.gather(
                *(self._http.post(http, url, "/v1/load_lora_adapter", f"loading adapter {name!r} from {path}",
                                  {"lora_name": name, "lora_path": str(path.resolve())})
                  for url in self.urls), return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                # leave no server with a version the sampler will never use, then report
                done = [u for u, r in zip(self.urls, results) if not isinstance(r, BaseException)]
                try:
                    await self._unload(http, done, name)
                except WeightSyncError:
                    pass  # the load failure below is the error worth reporting
                raise failed[0] if len(failed) == 1 else WeightSyncError(
                    f"{len(failed)} of {len(self.urls)} servers refused adapter {name!r}: "
                    + " | ".join(str(e) for e in failed))
            self.sampler.set_policy(name, version)
            self.loaded.append(version)
            t2 = time.perf_counter()
            retired, self.loaded = self.loaded[: -self.keep], self.loaded[-self.keep :]
            for old in retired:
                await self._unload(http, self.urls, self.name(old))
        await asyncio.to_thread(_prune_version_dirs, self.adapters_dir, set(self.loaded))
        t3 = time.perf_counter()
        self.last_timings = {"save_s": t1 - t0, "load_s": t2 - t1, "retire_s": t3 - t2}
        return t3 - t0

    async def retire_all(self) -> None:
        """Unload every version from the servers (the run switched to merged weights)."""
        async with aiohttp.ClientSession(timeout=self._http.timeout) as http:
            for version in self.loaded:
                await self._unload(http, self.urls, self.name(version))
        self.loaded = []

    async def _unload(self, http: aiohttp.ClientSession, urls: list[str], name: str) -> None:
        # 404: the server no longer has it (restarted, or unloaded by hand); that is the goal anyway
        await asyncio.gather(*(self._http.post(http, url, "/v1/unload_lora_adapter", f"unloading adapter {name!r}",
                                               {"lora_name": name}, ok=(404,)) for url in urls))


class FullWeightSync:
    """Full fine-tuning weight sync: save the whole model, then every server reloads it in place.

    vLLM 0.32 has no public endpoint to swap base weights, but its development endpoints do it
    without a restart; they exist only when the server runs with `VLLM_SERVER_DEV_MODE=1` (set it in
    the environment before `VLLMServer.start`). For each version `push`:
      1. saves the model (`save_pretrained`, safetensors) to `<run_dir>/weights/v{version}`;
      2. `POST /pause?mode=wait` on every server: in-flight requests finish on the old weights and
         new ones wait, so no sequence mixes two versions within a turn;
      3. `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": folder}}`
         loads the folder into the running model (every worker), then `POST /reset_prefix_cache`:
         KV blocks computed with the old weights must not be reused;
      4. `sampler.set_policy(served_name, version)`, then `POST /resume` on every server.
    Folders older than the newest `keep` are deleted (the server reads a folder only while reloading).

    Cost: the whole model crosses the disk each step (fp32 135M: ~0.5 GB), and sampling stops from
    the pause to the resume. On a GPU the server keeps its copy of the weights in GPU memory beside
    the trainer's (plan `VLLMServer.gpu_memory_utilization` for the trainer's weights, gradients and
    optimizer moments); the reload reads the folder through host memory and rebuilds the served
    model layer by layer, so its extra GPU memory is about one layer. For large models vLLM's NCCL
    weight-transfer endpoints (`/init_weight_transfer_engine`, `/update_weights`) avoid the disk;
    not implemented here. Where dev mode is not allowed, the honest fallback is a restart:
    `server.stop()`, set `server.model_dir` to the new folder, `server.start()` (~45 s per step on CPU).

    A failure resumes every server and leaves the sampler on the previous version. If the reload
    failed on one server after succeeding on another, they now serve different weights: treat the
    error as fatal for the run (restart the servers from the last checkpoint).
    """

    def __init__(self, run_dir: str | Path, sampler: VLLMSampler, *, served_name: str = "base", keep: int = 1,
                 timeout_s: float = 600.0, connect_timeout_s: float = 5.0,
                 write: Callable[[Any, Path], None] | None = None, weights_dir: str | Path | None = None):
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (got {keep})")
        # where versions are written and how (merged LoRA weights use their own: `rollout.merged`)
        self.weights_dir = Path(weights_dir) if weights_dir is not None else Path(run_dir) / "weights"
        self.write = write or (lambda model, folder: model.save_pretrained(folder, safe_serialization=True))
        self.sampler, self.served_name, self.keep = sampler, served_name, keep
        self.urls = [r.url for r in sampler.replicas]
        self._http = _Http(timeout_s, connect_timeout_s)
        self.versions: list[int] = []
        self.last_timings: dict[str, float] = {}

    async def push(self, model: Any, version: int) -> float:
        """Publish `model`'s full weights as `version` on every server; returns the seconds it took."""
        if self.versions and version <= self.versions[-1]:
            raise ValueError(f"version {version} is not newer than the last pushed ({self.versions[-1]})")
        t0 = time.perf_counter()
        path = await asyncio.to_thread(_write_version_dir, self.weights_dir, version, lambda d: self.write(model, d))
        t1 = time.perf_counter()
        async with aiohttp.ClientSession(timeout=self._http.timeout) as http:
            try:
                await self._on_all(http, "/pause?mode=wait", "pausing generation")
                t2 = time.perf_counter()
                await self._on_all(http, "/collective_rpc", f"reloading weights from {path}",
                                   {"method": "reload_weights", "kwargs": {"weights_path": str(path.resolve())}})
                await self._on_all(http, "/reset_prefix_cache", "resetting the prefix cache")
                self.sampler.set_policy(self.served_name, version)
            except BaseException:  # never leave a server paused; the first failure is the one to report
                with contextlib.suppress(WeightSyncError):
                    await asyncio.shield(self._on_all(http, "/resume", "resuming generation"))
                raise
            t3 = time.perf_counter()
            await self._on_all(http, "/resume", "resuming generation")
        self.versions = [*self.versions, version][-self.keep :]
        await asyncio.to_thread(_prune_version_dirs, self.weights_dir, set(self.versions))
        t4 = time.perf_counter()
        self.last_timings = {"save_s": t1 - t0, "drain_s": t2 - t1, "reload_s": t3 - t2, "resume_s": t4 - t3}
        return t4 - t0

    async def _on_all(self, http: aiohttp.ClientSession, path: str, what: str,
                      body: dict[str, Any] | None = None) -> None:
        await asyncio.gather(*(self._http.post(http, url, path, what, body) for url in self.urls))
