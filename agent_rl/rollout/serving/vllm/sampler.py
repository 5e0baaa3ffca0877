"""vLLM's client: token ids in, sampled token ids + log-probs + the policy version of each token + finish reason out.

Owns: `VLLMSampler` (aiohttp client of vLLM's `/v1/completions`, spread over replicas by least outstanding
requests, with deadlines and retries, and continuing a request that a weight push aborted), and the JSON it sends
and reads, public for the benches that time it (`request_body`, `read_response`, `response_completion`); the two
other completions the benches ask for (`exact_ids`: exactly n tokens, `prompt_logprobs`: a sequence scored).
Does not own: the protocols it fills in and the policy versions it tags (`rollout.sampler`), the server process
(`serving.vllm.server`), the server's other routes (`serving.vllm.backend`), loading adapters or pausing servers
(`rollout.weight_sync`).

The prompt is sent as token ids and the sampled ids come back as ids: no text round trip, so the
trainer sees exactly the tokens the sampler produced; the server echoes the prompt, which must be the ids sent.
Request and response are JSON written and read by orjson: a turn sends its whole context as ids and gets its
sampled ids, their log-probs and the echoed prompt back, which the standard library's json writes and reads
several times slower (`bench/sampler_json.py`); an echo that is the request's own JSON byte for byte is
compared as bytes, not read (`read_response`).

A weight push that reloads weights in place aborts the requests in flight (`rollout.sampler`, policy versions):
an aborted request keeps the tokens it sampled, tagged with the old version, and goes on from them under the new
one (`VLLMSampler.sample`). A request whose server died under it raises `ServerLost` (with a gate).
"""

from __future__ import annotations

import asyncio
import json
import random
import struct
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import orjson

from agent_rl.core.http import SessionOwner
from agent_rl.core.types import Message
from agent_rl.rollout.sampler import Completion, SamplerError, SamplingParams, ServerGate, ServerLost


@dataclass
class _Replica:
    url: str
    outstanding: int = 0


class VLLMSampler(SessionOwner):
    """Client of one or more vLLM OpenAI-compatible servers (data-parallel replicas)."""

    max_pieces = 64  # aborted pieces one turn may go on from before it is an error (each is a push's pause)

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
        self._open = asyncio.Event()  # cleared while a push holds the sampler (`hold`)
        self._open.set()
        self._in_flight: Counter[tuple[str, str]] = Counter()  # (url, model) -> requests sent, not answered
        self.gate: ServerGate | None = None  # set by a supervisor: requests go only to servers that are up

    @property
    def urls(self) -> list[str]:
        """The base URL of every server, in the order given."""
        return [r.url for r in self.replicas]

    def set_policy(self, model: str, version: int) -> None:
        """Route new requests to `model` (a loaded adapter name), tagged with `version`."""
        self.model, self.policy_version = model, version

    def hold(self) -> None:
        """New requests (and the continuations of aborted ones) wait until `release`: a push that pauses
        the servers first holds the sampler, so that no request is sent under a version being replaced."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def in_flight(self, url: str | None = None, model: str | None = None) -> int:
        """Requests sent and not yet answered (to the server `url`, for the served policy `model`)."""
        return sum(n for (u, m), n in self._in_flight.items() if url in (None, u) and model in (None, m))

    def _live(self) -> list[_Replica]:
        return [r for r in self.replicas if self.gate is None or self.gate.is_up(r.url)]

    def _pick(self) -> _Replica:
        live = self._live()
        low = min(r.outstanding for r in live)
        return random.choice([r for r in live if r.outstanding == low])

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
                     messages: Sequence[Message] = ()) -> Completion:
        """One turn. A piece that a weight push aborted (finish "abort", module doc) is continued: its tokens
        become part of the next piece's prompt, which samples the rest of the budget under the version then
        served, with a seed of its own (the same seed again would redraw the first piece's random numbers)."""
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        finish = "abort"
        for _ in range(self.max_pieces):
            if len(ids) >= params.max_tokens or (ids and ids[-1] in params.stop_token_ids):
                finish = "length" if len(ids) >= params.max_tokens else "stop"  # aborted just as it ended
                break
            seed = None if params.seed is None else (params.seed + 7919 * len(ids)) & 0x7FFFFFFF
            same = not ids and seed == params.seed  # a turn's first request, as most are: no copies to make
            piece = await self._request(prompt_ids if same else [*prompt_ids, *ids], params if same else
                                        replace(params, max_tokens=params.max_tokens - len(ids), seed=seed))
            if same and piece.finish_reason != "abort":
                return piece  # the turn in one piece, as most are: already the turn's completion, no copies
            ids += piece.token_ids
            logprobs += piece.logprobs
            versions += piece.versions
            finish = piece.finish_reason
            if finish != "abort":
                break
        else:
            raise SamplerError(f"a request was aborted {self.max_pieces} times in a row (each a weight push's pause)")
        version = versions[0] if versions else self.policy_version
        return Completion(tuple(ids), tuple(logprobs), finish, version, tuple(versions))

    async def _wait_open(self) -> None:
        if self._open.is_set():
            return
        try:
            await asyncio.wait_for(self._open.wait(), self.timeout.total)
        except TimeoutError:
            raise SamplerError(f"the servers stayed paused for a weight push longer than {self.timeout.total:g} s "
                               f"(sampler.request_timeout_s)") from None

    async def _ready(self) -> _Replica:
        """The server for the next attempt: once no push holds the sampler and some server is up (module doc)."""
        await self._wait_open()
        while not self._live():  # every server down: wait for one (a gate's wait has its own deadline)
            assert self.gate is not None
            await self.gate.wait_up(self.timeout.total or 300.0)
            await self._wait_open()
        return self._pick()

    async def _request(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        """One request, retried on server errors and timeouts; each attempt waits while a push holds the
        sampler (and while no server is up), then reads the served policy and its version. A server that died
        under it ends it with `ServerLost` (module doc)."""
        prompt = orjson.dumps(prompt_ids)  # written once: the request holds it, the echo is compared with it
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            replica = await self._ready()
            model, version = self.model, self.policy_version
            replica.outstanding += 1
            self._in_flight[replica.url, model] += 1
            try:
                async with self.http().post(replica.url + "/v1/completions", data=request_body(model, prompt, params),
                                            headers=_JSON) as resp:
                    if resp.status >= 400:
                        text = (await resp.text())[:300]
                        if resp.status < 500:  # our request is wrong: retrying will not help
                            raise SamplerError(f"{replica.url} rejected the request ({resp.status}): {text}")
                        raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status, message=text)
                    raw = await resp.read()
                return response_completion(read_response(raw, replica.url, prompt), prompt_ids, version, replica.url)
            except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
                last = e
            finally:
                replica.outstanding -= 1
                self._in_flight[replica.url, model] -= 1
            # an HTTP error came from a server alive enough to answer; any other failure may be its death
            answered = isinstance(last, aiohttp.ClientResponseError)
            if self.gate is not None and not answered and await self.gate.lost(replica.url):
                raise ServerLost(f"vLLM server {replica.url} went down with the request in flight "
                                 f"({type(last).__name__}: {last})")
            if attempt < self.retries:
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise SamplerError(f"vLLM server {replica.url} did not answer after {self.retries + 1} attempts: "
                           f"{type(last).__name__}: {last}")


_JSON = {"Content-Type": "application/json"}


def request_body(model: str, prompt: bytes, params: SamplingParams) -> bytes:
    """The request's JSON around `prompt`, the prompt ids' JSON (orjson: the whole context's ids are written
    again every turn, module doc)."""
    body: dict[str, Any] = {
        "prompt": orjson.Fragment(prompt), "model": model, "max_tokens": params.max_tokens,
        "temperature": params.temperature, "top_p": params.top_p, "logprobs": 0,
        "return_token_ids": True, "skip_special_tokens": False,
        "stop_token_ids": params.stop_token_ids,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    return orjson.dumps(body)


_ECHO = b'"prompt_token_ids":'
_LOGPROBS = b'"logprobs":{"text_offset":['
_TOKEN_LOGPROBS = b',"token_logprobs":['
_TOKENS = b',"tokens":['
_LOGPROBS_END = b']},"finish_reason":'


def _token_texts(raw: bytes) -> tuple[int, int, int, int] | None:
    """Where a response's logprobs hold what VLLMSampler does not read, as vLLM 0.32 writes them: each token's
    offset, text and top-1 entry (`logprobs: 0` gives them beside its log-prob: ~5 objects a token to read, against
    one for the log-prob). (a, b, c, d): `raw[a:b]` is `"text_offset":[...],`, `raw[c:d]` is `,"tokens":[...],
    "top_logprobs":[...]`; None where the response is written otherwise (then it is read whole).

    The offsets and log-probs are numbers (and nulls) only, so the first "]" after each opening ends it. In the
    texts and entries every quote inside a string is escaped, so the first `]},"finish_reason":` after them is
    where the logprobs end: the texts' array closes with "]," and each entry with "}," or "}]"."""
    a = raw.find(_LOGPROBS)
    if a < 0:
        return None
    a += len(b'"logprobs":{')
    b = raw.find(b"]", a) + 2
    if not raw.startswith(_TOKEN_LOGPROBS, b - 1):
        return None
    c = raw.find(b"]", b) + 1
    if c == 0 or not raw.startswith(_TOKENS, c):
        return None
    d = raw.find(_LOGPROBS_END, c) + 1
    return (a, b, c, d) if d > 0 else None


def read_response(raw: bytes, url: str, prompt: bytes = b"") -> Any:
    """A response's JSON, without what VLLMSampler does not read: the logprobs' token texts (`_token_texts`) and an
    echoed prompt that is `prompt` (the JSON of the ids sent) byte for byte, which is null in it.

    Such an echo is cut out before the rest is read: reading ~1k ids back to compare them with the ids sent
    costs more than the rest of a reply (bench/sampler_json.py), and identical JSON is identical ids. The
    key's bytes, looked for after the logprobs (the token texts are keys there), can only be a key: inside a JSON
    string every quote is escaped. Any other echo (written another way, or other ids) is read as it is, and
    `response_completion` compares its ids. orjson refuses NaN and Infinity, which a server written in Python may send:
    such a body is read by the standard library's json."""
    kept: list[bytes] = []
    start = 0
    texts = _token_texts(raw)
    if texts is not None:
        a, b, c, d = texts
        kept += [raw[:a], raw[b:c]]
        start = d
    at = raw.find(_ECHO, start) + len(_ECHO) if prompt else -1
    if at >= len(_ECHO) and raw.startswith(prompt, at):
        kept += [raw[start:at], b"null"]
        start = at + len(prompt)
    if kept:
        raw = b"".join([*kept, raw[start:]])
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:
            return json.loads(raw)
        except ValueError:
            head = raw[:120].decode("utf-8", "replace")
            raise SamplerError(f"{url} sent a response that is not JSON: {head!r}") from None


def response_completion(data: dict[str, Any], prompt_ids: Sequence[int], version: int, url: str) -> Completion:
    """The completion of a response's first choice; its echoed prompt, if any, must be the ids sent (one
    that `read_response` found to be their JSON byte for byte it has already replaced by null)."""
    try:
        choice = data["choices"][0]
        ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        # C loops that refuse an id not a 64-bit int (struct.error) and a log-prob not a number (TypeError): cheaper
        # than array("q") and array("d"), which convert each element (docs/performance.md#smaller-measurements)
        struct.pack(f"{len(ids)}q", *ids), sum(logprobs, 0.0)
        ids, logprobs = tuple(ids), tuple(logprobs)
        finish = choice["finish_reason"]
        echoed = choice.get("prompt_token_ids")
    except (KeyError, IndexError, TypeError, struct.error) as e:
        why = "a token id that is not a 64-bit integer" if isinstance(e, struct.error) else f"{type(e).__name__}: {e}"
        raise SamplerError(f"{url} sent an unexpected completion ({why}); "
                           f"is it a vLLM server with return_token_ids support?") from None
    if len(ids) != len(logprobs):
        raise SamplerError(f"{url} sent {len(ids)} token ids but {len(logprobs)} log-probs")
    if echoed is not None and _as_list(echoed) != _as_list(prompt_ids):
        raise SamplerError(f"{url} changed the prompt tokens: the sampler must see exactly the ids sent")
    return Completion(ids, logprobs, finish if finish in ("length", "abort") else "stop", version)


def _as_list(ids: Sequence[int]) -> list[int]:
    return ids if isinstance(ids, list) else list(ids)  # no copy of a ~1k-id prompt just to compare it


# -- requests the benches make beside the sampler's ---------------------------------------------------------------


async def exact_ids(http: aiohttp.ClientSession, url: str, model: str, prompt: Sequence[int], n: int) -> list[int]:
    """The ids of one request for exactly `n` tokens after `prompt` (`ignore_eos` + `min_tokens`): raw generation
    of a known length, which bench/rollout.py compares rollouts with."""
    body = {"model": model, "prompt": list(prompt), "max_tokens": n, "min_tokens": n, "ignore_eos": True,
            "temperature": 1.0, "logprobs": 0, "return_token_ids": True}
    async with http.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        return (await resp.json())["choices"][0]["token_ids"]


async def prompt_logprobs(http: aiohttp.ClientSession, url: str, model: str, ids: Sequence[int]) -> list[float]:
    """The server's log-prob of each of `ids` after the ones before it (the first has none: `len(ids) - 1` of them),
    at temperature 1: what bench/gpu_check.py compares with the trainer's."""
    body = {"model": model, "prompt": list(ids), "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
    async with http.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        entries = (await resp.json())["choices"][0]["prompt_logprobs"][1:]
    return [e[str(t)]["logprob"] for e, t in zip(entries, ids[1:])]
