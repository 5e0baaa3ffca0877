"""LoRA weight sync: each optimizer step becomes a new adapter version on every server.

Owns: `AdapterSync`: writing each version of the adapter to `<run_dir>/adapters/v{version}`, loading it
as `{prefix}-v{version}` on every server, retiring old versions on the servers and on disk, pointing the
sampler at the new version; loading a starting adapter (SFT's) as version 0; and `restore`: a server back
in service gets every version still loaded, under its own name.
Does not own: the calls to the servers and version folders (`weight_sync.base`, through `rollout.serving`), merged
weights (`weight_sync.merged`), starting servers (`rollout.serving`), training checkpoints (`runs.checkpoint`).

A name is never reloaded with new weights: the server (vLLM) keys its prefix cache on the adapter's (name, path), so
a reload would serve KV blocks computed with the old weights. A push needs no pause: requests in flight name
their adapter and finish on it. The newest `keep` versions stay loaded (k + 1 under a staleness bound of k,
`choose.start_weight_sync`), and an older one for as long as a request of the sampler's runs on it, so a
request in flight always finishes with its own version (vLLM reloads an unloaded adapter a running request
still names from its folder, which would be gone).
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from agent_rl.rollout.sampler import ServedSampler
from agent_rl.rollout.weight_sync.base import Gone, Servers, WeightSyncError, prune_version_dirs, write_version_dir


class AdapterSync:
    """LoRA weight sync: each optimizer step becomes a new adapter version on every server.

        sync = AdapterSync(run_dir, sampler)
        await sync.load_initial(sft_adapter_dir)      # optional: version 0
        seconds = await sync.push(peft_model, step)   # after each optimizer step

    `push` saves the adapter (peft `save_pretrained`, safetensors) to `<run_dir>/adapters/v{version}`,
    loads it as `{prefix}-v{version}` on every server URL of the sampler (concurrently), calls
    `sampler.set_policy(name, version)`, then unloads all but the newest `keep` versions from the
    servers and deletes their folders (an older version a request still runs on stays until a later push).
    Without `load_initial` the sampler stays on the base model, which is version 0 of a fresh LoRA (peft
    initialises B = 0).

    Versions must increase. A server that still holds `{prefix}-v{n}` from an earlier process
    refuses to load it again (we never reload a name with other weights): after a resume on a
    long-lived server, pass a `prefix` unique to the run. A retry of a request goes to the newest version
    (and is tagged with it).
    """

    def __init__(self, run_dir: str | Path, sampler: ServedSampler, *, keep: int = 2, prefix: str = "policy",
                 timeout_s: float = 120.0, connect_timeout_s: float = 5.0):
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (got {keep})")
        self.adapters_dir = Path(run_dir) / "adapters"
        self.sampler, self.keep, self.prefix = sampler, keep, prefix
        self.servers = Servers(sampler.urls, timeout_s, connect_timeout_s, sampler.gate)
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

    async def _publish(self, write: Callable[[Path], object], version: int) -> float:
        if self.loaded and version <= self.loaded[-1]:
            raise ValueError(f"version {version} is not newer than the last pushed ({self.loaded[-1]}): "
                             f"adapter names are never reused")
        t0 = time.perf_counter()
        # in a thread: rollouts sharing this event loop keep streaming while the file is written
        path = await asyncio.to_thread(write_version_dir, self.adapters_dir, version, write)
        t1 = time.perf_counter()
        name = self.name(version)
        servers, backend = self.servers, self.servers.backend
        async with servers.lock, servers.session() as http:  # a restore waits for the push to end
            urls = servers.live()  # a server down now gets this version from its restore
            results = await asyncio.gather(*(servers.call(url, backend.load_adapter(http, url, name, path))
                                             for url in urls), return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException) and not isinstance(r, Gone)]
            if failed:
                # leave no server with a version the sampler will never use, then report
                done = [u for u, r in zip(urls, results) if not isinstance(r, BaseException)]
                try:
                    await self._unload(http, done, name)
                except WeightSyncError:
                    pass  # the load failure below is the error worth reporting
                raise failed[0] if len(failed) == 1 else WeightSyncError(
                    f"{len(failed)} of {len(urls)} servers refused adapter {name!r}: "
                    + " | ".join(str(e) for e in failed))
            self.sampler.set_policy(name, version)
            self.loaded.append(version)
            t2 = time.perf_counter()
            # past the newest `keep`, the versions no request of the sampler's runs on (the others wait for a
            # later push); none is sent to them any more: new requests and retries name the newest
            retired = [v for v in self.loaded[: -self.keep] if not self.sampler.in_flight(model=self.name(v))]
            self.loaded = [v for v in self.loaded if v not in retired]
            for old in retired:
                await self._unload(http, servers.live(), self.name(old))
        await asyncio.to_thread(prune_version_dirs, self.adapters_dir, set(self.loaded))
        t3 = time.perf_counter()
        self.last_timings = {"save_s": t1 - t0, "load_s": t2 - t1, "retire_s": t3 - t2}
        return t3 - t0

    async def restore(self, url: str) -> None:
        """The server at `url` is back: load every version still loaded on the others that it lacks (a restarted
        one lacks all; an attached one that answers again may hold them still, and a name is never loaded twice),
        from the version folders, which stay on disk while their version is loaded."""
        async with self.servers.lock, self.servers.session() as http:
            held = await self.servers.adapters(http, url)
            for version in self.loaded:
                if (name := self.name(version)) not in held:
                    path = (self.adapters_dir / f"v{version}").resolve()
                    await self.servers.call(url, self.servers.backend.load_adapter(http, url, name, path))

    async def finish(self) -> None:
        """Nothing to restore: the servers' own weights were never touched (the run's last adapters stay
        loaded; `retire_all` unloads them)."""

    async def retire_all(self) -> None:
        """Unload every version from the servers (the run switched to merged weights)."""
        async with self.servers.session() as http:
            for version in self.loaded:
                await self._unload(http, self.servers.live(), self.name(version))
        self.loaded = []

    async def _unload(self, http: aiohttp.ClientSession, urls: list[str], name: str) -> None:
        """`name` unloaded from `urls` (a server that no longer holds it, restarted or unloaded by hand, is done)."""
        await self.servers.on_all(lambda url: self.servers.backend.unload_adapter(http, url, name), urls=urls)
