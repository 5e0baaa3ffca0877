"""Samplers: token ids in, sampled token ids + log-probs + finish reason out.

Owns: the `Sampler` protocol (what the runner samples through), `ServedSampler` (a sampler over servers
whose served policy a weight sync switches) and `VLLMSampler` (aiohttp client of vLLM's
`/v1/completions`, spread over replicas by least outstanding requests, with deadlines and retries).
Does not own: starting servers (`rollout.server`), loading adapters (`rollout.weight_sync`), chat
rendering (`core.renderer`), scripted and human samplers (`rollout.scripted`, `play`).

The prompt is sent as token ids and the sampled ids come back as ids: no text round trip, so the
trainer sees exactly the tokens the sampler produced.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from agent_rl.core.http import SessionOwner
from agent_rl.core.types import Message


class SamplerError(Exception):
    """The sampler could not produce a completion (server down, timeout, bad response)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # one per sampled token, under the sampling distribution
    finish_reason: str  # "stop" or "length"
    policy_version: int = 0


class Sampler(Protocol):
    """Samples one assistant turn. `messages` is the conversation the ids render, for samplers that
    act on messages (a scripted solver); token samplers ignore it."""

    policy_version: int

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
                     messages: Sequence[Message] = ()) -> Completion: ...


class ServedSampler(Sampler, Protocol):
    """A sampler over vLLM servers, as a weight sync sees it: the servers' URLs, and the served policy
    (`model`: a served name, "base" or a loaded adapter's) that new requests go to, switched after a push."""

    model: str

    @property
    def urls(self) -> list[str]: ...

    def set_policy(self, model: str, version: int) -> None: ...


@dataclass
class _Replica:
    url: str
    outstanding: int = 0


class VLLMSampler(SessionOwner):
    """Client of one or more vLLM OpenAI-compatible servers (data-parallel replicas)."""

    def __init__(self, urls: Sequence[str], model: str = "base", *, request_timeout_s: float = 300.0,
                 connect_timeout_s: float = 5.0, retries: int = 3, backoff_s: float = 0.5):
        if not urls:
            raise ValueError("VLLMSampler needs at least one server URL")
        self.replicas = [_Replica(u.rstrip("/")) for u in urls]
        self.model = model  # the served name: "base" or a LoRA adapter's versioned name
        self.policy_version = 0
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=connect_timeout_s)
        self.retries, self.backoff_s = retries, backoff_s
        self.connector_limit = 0  # every rollout's request in flight at once

    @property
    def urls(self) -> list[str]:
        """The base URL of every server, in the order given."""
        return [r.url for r in self.replicas]

    def set_policy(self, model: str, version: int) -> None:
        """Route new requests to `model` (a loaded adapter name), tagged with `version`."""
        self.model, self.policy_version = model, version

    def _pick(self) -> _Replica:
        low = min(r.outstanding for r in self.replicas)
        return random.choice([r for r in self.replicas if r.outstanding == low])

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
                     messages: Sequence[Message] = ()) -> Completion:
        model, version = self.model, self.policy_version
        body: dict[str, Any] = {
            "model": model, "prompt": list(prompt_ids), "max_tokens": params.max_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "logprobs": 0,
            "return_token_ids": True, "skip_special_tokens": False,
            "stop_token_ids": list(params.stop_token_ids),
        }
        if params.seed is not None:
            body["seed"] = params.seed
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            replica = self._pick()
            replica.outstanding += 1
            try:
                async with self.http().post(replica.url + "/v1/completions", json=body) as resp:
                    if resp.status >= 400:
                        text = (await resp.text())[:300]
                        if resp.status < 500:  # our request is wrong: retrying will not help
                            raise SamplerError(f"{replica.url} rejected the request ({resp.status}): {text}")
                        raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status, message=text)
                    data = await resp.json()
                return _completion(data, prompt_ids, version, replica.url)
            except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
                last = e
            finally:
                replica.outstanding -= 1
            if attempt < self.retries:
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise SamplerError(f"vLLM server {replica.url} did not answer after {self.retries + 1} attempts: "
                           f"{type(last).__name__}: {last}")


def _completion(data: dict[str, Any], prompt_ids: Sequence[int], version: int, url: str) -> Completion:
    try:
        choice = data["choices"][0]
        ids = tuple(map(int, choice["token_ids"]))
        logprobs = tuple(map(float, choice["logprobs"]["token_logprobs"]))
        finish = choice["finish_reason"]
        echoed = choice.get("prompt_token_ids")
    except (KeyError, IndexError, TypeError) as e:
        raise SamplerError(f"{url} sent an unexpected completion ({type(e).__name__}: {e}); "
                           f"is it a vLLM server with return_token_ids support?") from None
    if len(ids) != len(logprobs):
        raise SamplerError(f"{url} sent {len(ids)} token ids but {len(logprobs)} log-probs")
    if echoed is not None and _as_list(echoed) != _as_list(prompt_ids):
        raise SamplerError(f"{url} changed the prompt tokens: the sampler must see exactly the ids sent")
    return Completion(ids, logprobs, "length" if finish == "length" else "stop", version)


def _as_list(ids: Sequence[int]) -> list[int]:
    return ids if isinstance(ids, list) else list(ids)  # no copy of a ~1k-id prompt just to compare it
