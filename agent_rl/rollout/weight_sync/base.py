"""What every weight sync shares: the protocol the trainer calls, the calls to the servers, the version folders.

Owns: `WeightSync` (the protocol: `push(model, version)` after each optimizer step, `finish()` at the end
of a run), `WeightSyncError`, `Servers` (POST to every server of a sampler with a deadline, each error
naming the server and quoting its reply; `reload_in_place`, the one place the pause -> reload ->
reset-prefix-cache -> resume sequence is written), and the version folders on disk (`write_version_dir`,
`prune_version_dirs`).
Does not own: what a version is (`adapter`, `full`, `merged`), which sync a run uses (`choose`),
the sampler (`rollout.sampler`).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from agent_rl.core.files import atomic_dir


class WeightSyncError(Exception):
    """A server did not take the new weights; the message names the server and quotes its reply."""


class WeightSync(Protocol):
    """Makes every server sample from the trainer's policy. Versions increase: a version is the number of
    optimizer steps its weights have taken, and the sampler tags each completion with it."""

    async def push(self, model: Any, version: int) -> float:
        """Publish `model` (a peft model, a full model, or weights gathered whole) as `version` on every
        server and point the sampler at it; returns the seconds it took."""
        ...

    async def finish(self) -> None:
        """The run is over: leave the servers as a later user expects them (a no-op where nothing is to
        restore). Called once, also after the run failed."""
        ...


_VERSION_DIR = re.compile(r"^v(\d+)$")


def write_version_dir(parent: Path, version: int, write: Callable[[Path], object]) -> Path:
    """`write(folder)` into `parent/v{version}`, atomically (`core.files.atomic_dir`): a version folder
    exists only once complete; one of the same version (a resumed run writing it again) is replaced."""
    final = parent / f"v{version}"
    with atomic_dir(final) as tmp:
        write(tmp)
    return final


def prune_version_dirs(parent: Path, keep_versions: set[int]) -> None:
    """Delete every `v{n}` folder not in `keep_versions` (older versions, or a crashed run's)."""
    if not parent.is_dir():
        return
    for path in parent.iterdir():
        m = _VERSION_DIR.match(path.name)
        if m and int(m.group(1)) not in keep_versions:
            shutil.rmtree(path, ignore_errors=True)


def _nothing() -> None:
    pass


class Servers:
    """The servers a sync talks to: every call has a deadline; every error names the server and quotes its reply."""

    def __init__(self, urls: Sequence[str], timeout_s: float, connect_timeout_s: float):
        self.urls = list(urls)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)

    def session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(timeout=self.timeout)

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

    async def on_all(self, http: aiohttp.ClientSession, path: str, what: str,
                     body: dict[str, Any] | None = None) -> None:
        """The same POST to every server, concurrently; the first failure is raised."""
        await asyncio.gather(*(self.post(http, url, path, what, body) for url in self.urls))

    async def reload_in_place(self, folder: Path, what: str, switch: Callable[[], None] = _nothing
                              ) -> dict[str, float]:
        """Every server replaces its weights with those in `folder`, through vLLM's development endpoints
        (servers started with `VLLM_SERVER_DEV_MODE=1`):
          1. `POST /pause?mode=wait`: requests in flight finish on the old weights and new ones wait, so no
             sequence mixes two versions within a turn;
          2. `POST /collective_rpc` `reload_weights` from `folder` (every worker), then `POST
             /reset_prefix_cache`: KV blocks computed with the old weights must not be reused;
          3. `switch()` (the sampler onto the new version), then `POST /resume`.
        A failure resumes every server (never left paused) and is raised; the first one is reported.
        Returns the seconds of each phase: `drain_s` (the pause), `reload_s`, `resume_s`."""
        async with self.session() as http:
            t0 = time.perf_counter()
            try:
                await self.on_all(http, "/pause?mode=wait", "pausing generation")
                t1 = time.perf_counter()
                await self.on_all(http, "/collective_rpc", f"reloading {what} from {folder}",
                                  {"method": "reload_weights", "kwargs": {"weights_path": str(folder.resolve())}})
                await self.on_all(http, "/reset_prefix_cache", "resetting the prefix cache")
                switch()
            except BaseException:
                with contextlib.suppress(WeightSyncError):
                    await asyncio.shield(self.on_all(http, "/resume", "resuming generation"))
                raise
            t2 = time.perf_counter()
            await self.on_all(http, "/resume", "resuming generation")
        return {"drain_s": t1 - t0, "reload_s": t2 - t1, "resume_s": time.perf_counter() - t2}
