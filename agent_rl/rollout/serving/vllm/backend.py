"""vLLM as a serving backend: `serving.base.ServingBackend` filled in with vLLM's routes.

Owns: `VLLMBackend` (its sampler and its servers, from `serving.vllm.sampler` and `serving.vllm.server`, and each
call to one server: `/health`; the development routes of a server in dev mode (`VLLM_SERVER_DEV_MODE=1`):
`/is_paused`, `/pause`, `/abort_requests`, `/resume`, `/collective_rpc` `reload_weights` and `/reset_prefix_cache`;
the runtime LoRA routes (`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`): `/v1/load_lora_adapter`,
`/v1/unload_lora_adapter` and the adapters `/v1/models` lists; the Prometheus counters of `/metrics`), each
failure a `ServerCallError` that names the server and the route and quotes the reply.
Does not own: the order of a push's calls and which servers get them (`rollout.weight_sync`), when a server is down
(`rollout.supervisor`), the protocol (`serving.base`).

vLLM 0.32 has no public route to swap base weights; its development routes do it without a restart. For large
models its NCCL weight-transfer routes (`/init_weight_transfer_engine`, `/update_weights`) would avoid the disk;
not used here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import aiohttp

from agent_rl.core.config import ModelConfig, SamplerConfig
from agent_rl.rollout.serving.base import Fleet, ServerCallError
from agent_rl.rollout.serving.vllm import server
from agent_rl.rollout.serving.vllm.sampler import VLLMSampler

# the backend's counter names -> vLLM's Prometheus series (counters end in _total; summed over engines' labels)
COUNTERS = {"generation_tokens": "vllm:generation_tokens_total",
            "prefix_cache_queries": "vllm:prefix_cache_queries_total",
            "prefix_cache_hits": "vllm:prefix_cache_hits_total", "requests_running": "vllm:num_requests_running"}
_SERIES = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? (\S+)$", re.M)


class VLLMBackend:
    """vLLM's servers, sampler and routes (module doc); no state of its own."""

    def serve(self, model: ModelConfig, sampler: SamplerConfig, seed: int, model_dir: str | Path,
              log_path: Path | None = None, tokenizer: str | Path | None = None) -> AbstractContextManager[Fleet]:
        return server.serve(model, sampler, seed, model_dir, log_path, tokenizer)

    def sampler(self, urls: Sequence[str], *, request_timeout_s: float = 300.0) -> VLLMSampler:
        return VLLMSampler(urls, request_timeout_s=request_timeout_s)

    async def health(self, http: aiohttp.ClientSession, url: str, timeout_s: float) -> bool:
        try:
            async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def can_reload(self, http: aiohttp.ClientSession, url: str) -> bool:
        """Whether the server has vLLM's development routes (started with `VLLM_SERVER_DEV_MODE=1`)."""
        try:
            async with http.get(url + "/is_paused") as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def pause(self, http: aiohttp.ClientSession, url: str, *, abort: bool = True) -> None:
        await _post(http, url, f"/pause?mode={'abort' if abort else 'wait'}", "pausing generation")

    async def abort_requests(self, http: aiohttp.ClientSession, url: str) -> None:
        await _post(http, url, "/abort_requests", "aborting the requests that came during the pause")

    async def resume(self, http: aiohttp.ClientSession, url: str) -> None:
        await _post(http, url, "/resume", "resuming generation")

    async def load_weights(self, http: aiohttp.ClientSession, url: str, folder: Path) -> None:
        """`reload_weights` on every worker of the server, then its prefix cache reset."""
        await _post(http, url, "/collective_rpc", f"reloading weights from {folder}",
                    {"method": "reload_weights", "kwargs": {"weights_path": str(folder.resolve())}})
        await _post(http, url, "/reset_prefix_cache", "resetting the prefix cache")

    async def load_adapter(self, http: aiohttp.ClientSession, url: str, name: str, folder: Path) -> None:
        await _post(http, url, "/v1/load_lora_adapter", f"loading adapter {name!r} from {folder}",
                    {"lora_name": name, "lora_path": str(folder.resolve())})

    async def unload_adapter(self, http: aiohttp.ClientSession, url: str, name: str) -> None:
        # 404: the server no longer has it (restarted, or unloaded by hand); that is the goal anyway
        await _post(http, url, "/v1/unload_lora_adapter", f"unloading adapter {name!r}", {"lora_name": name}, ok=(404,))

    async def adapters(self, http: aiohttp.ClientSession, url: str) -> dict[str, str]:
        """The model cards `/v1/models` lists that have a parent (the base model): each adapter's name and root."""
        try:
            async with http.get(url + "/v1/models") as resp:
                cards = (await resp.json())["data"]
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, KeyError) as e:
            answered = not isinstance(e, (TimeoutError, OSError, aiohttp.ClientConnectionError))
            raise ServerCallError(f"vLLM server {url} did not list its models: {type(e).__name__}: {e}",
                                  answered=answered) from None
        return {c["id"]: str(c.get("root", "")) for c in cards if c.get("parent")}

    async def counters(self, http: aiohttp.ClientSession, url: str) -> dict[str, float]:
        try:
            async with http.get(url + "/metrics") as resp:
                text = await resp.text()
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise ServerCallError(f"vLLM server {url} did not answer GET /metrics: {type(e).__name__}: {e}",
                                  answered=False) from None
        return read_counters(text)


def read_counters(text: str) -> dict[str, float]:
    """`COUNTERS` read from a Prometheus page, each series summed over its labels (0 where the page has none)."""
    sums: dict[str, float] = {}
    for name, value in _SERIES.findall(text):
        try:
            sums[name] = sums.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return {ours: sums.get(theirs, 0.0) for ours, theirs in COUNTERS.items()}


async def _post(http: aiohttp.ClientSession, url: str, path: str, what: str, body: dict[str, Any] | None = None,
                ok: tuple[int, ...] = ()) -> None:
    """POST `body` (JSON; {} without one) to `url + path`; ServerCallError unless the status is 2xx or in `ok`."""
    try:
        async with http.post(url + path, json=body if body is not None else {}) as resp:
            status, text = resp.status, await resp.text()
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        raise ServerCallError(f"vLLM server {url} did not answer POST {path} ({what}): "
                              f"{type(e).__name__}: {e or 'timed out'}", answered=False) from None
    if status >= 400 and status not in ok:
        hint = ""
        if status == 404 and "Not Found" in text[:40]:
            hint = (" (the endpoint does not exist: LoRA loading needs "
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, in-place reloading VLLM_SERVER_DEV_MODE=1)")
        raise ServerCallError(f"vLLM server {url} refused {what} (HTTP {status}): {text[:500]!r}{hint}", answered=True)
