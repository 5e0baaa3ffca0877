"""The simulated servers' responses: what vLLM 0.32 writes for VLLMSampler's request, byte for byte, made cheaply.

Owns: `response_json` (the response, written field by field as vLLM writes it: the reference), `Responses` (the
same bytes from fragments made once), `token_pieces` (each id's text), `LOGPROBS` (the log-probs the replies carry),
`ServerWork` (the servers' time in this process).
Does not own: when a server answers (`sim_servers`), what a reply says (`sim_episodes.SimSampler`), reading a
response (VLLMSampler's `read_response`, `response_completion`).

Why fragments: writing a response is the servers' work, yet here it runs in the measured process, where written
whole each turn it took a quarter of the runner process's CPU (docs/performance.md#the-runner-at-scale-by-simulation).
A reply is a prefix of one long sequence and a short ending, and an echo is the request's own JSON: so each prefix's
JSON is cut from text written once and only the ending is written per turn, on the runner's side and the ideal
client's alike (tests/test_bench_sim_responses.py checks the bytes against `response_json`).
"""

from __future__ import annotations

import functools
import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from agent_rl.core.renderers.base import Renderer

T = TypeVar("T")

LOGPROBS = [-round(random.Random(i).expovariate(0.5), 12) - 1e-9 * i for i in range(4096)]  # as vLLM writes them:
# a sampled token's log-prob at full precision, e.g. -10.631866455078125
NUMBERS = [orjson.dumps(p) for p in LOGPROBS]  # each one's JSON


@functools.lru_cache(maxsize=4)
def token_pieces(renderer: Renderer) -> tuple[str, ...]:
    """Each id's text, as a vLLM response's `logprobs.tokens` gives it (the server's work, made once)."""
    return tuple(renderer.decode_raw([i]) for i in range(len(renderer.tokenizer)))


def response_json(prompt_ids: Sequence[int], ids: list[int], pieces: Sequence[str]) -> bytes:
    """The JSON of vLLM's completions response to VLLMSampler's request, field for field as vLLM 0.32 writes it
    (`logprobs: 0` gives each token's log-prob, text, offset and top-1 entry; `return_token_ids` the prompt's and
    reply's ids)."""
    tokens = [pieces[i] for i in ids]
    logprobs = LOGPROBS[:len(ids)]
    return orjson.dumps({
        "id": "cmpl-sim", "object": "text_completion", "created": 0, "model": "sim",
        "choices": [{"index": 0, "text": "".join(tokens),
                     "logprobs": {"text_offset": list(itertools.accumulate(map(len, tokens), initial=0))[:len(ids)],
                                  "token_logprobs": logprobs, "tokens": tokens,
                                  "top_logprobs": [{t: p} for t, p in zip(tokens, logprobs)]},
                     "finish_reason": "stop", "stop_reason": None, "token_ids": ids, "prompt_logprobs": None,
                     "prompt_token_ids": prompt_ids, "routed_experts": None}],
        "service_tier": None, "system_fingerprint": "vllm-sim", "kv_transfer_params": None, "metrics": None,
        "usage": {"prompt_tokens": len(prompt_ids), "total_tokens": len(prompt_ids) + len(ids),
                  "completion_tokens": len(ids), "prompt_tokens_details": None, "completion_tokens_details": None}})


@dataclass
class ServerWork:
    """The simulated servers' work in this process, timed: writing each response's JSON, choosing each reply's
    length, and on the runner's side which reply it is and the fingerprints of a context's ids the prefix cache
    compares (wall clock: it never waits, and a CPU clock costs several times more a read here:
    docs/performance.md#smaller-measurements)."""

    seconds: float = 0.0

    def timed(self, work: Callable[..., T], *args: Any) -> T:
        t = time.perf_counter()
        out = work(*args)
        self.seconds += time.perf_counter() - t
        return out


class _Prefixes:
    """The JSON of every prefix of one list of fragments: `take(k)` is the first k joined by `sep`, a slice."""

    def __init__(self, fragments: Sequence[bytes], sep: bytes = b","):
        self.data = sep.join(fragments)
        ends = itertools.accumulate((len(f) + len(sep) for f in fragments), initial=0)
        self.ends = [max(0, e - len(sep)) for e in ends]

    def take(self, k: int) -> bytes:
        return self.data[:self.ends[k]]


def _list(head: bytes, tail: bytes) -> bytes:
    return b"[" + head + (b"," if head and tail else b"") + tail + b"]"


class Responses:
    """`response_json(prompt, [*base[:n], *tail], pieces)`, byte for byte, for replies that start with a prefix of
    `base` (module doc): the prefix's fragments cut from text written once, the tail's written per call."""

    def __init__(self, base: Sequence[int], pieces: Sequence[str]):
        self.pieces = pieces
        self.tails: dict[tuple[int, ...], tuple[list[bytes], list[int], bytes]] = {}  # an ending's texts, lengths, ids
        texts = [orjson.dumps(pieces[i]) for i in base]
        numbers = NUMBERS[:len(base)]
        self.chars = list(itertools.accumulate((len(pieces[i]) for i in base), initial=0))
        self.ids = _Prefixes([b"%d" % i for i in base])
        self.text = _Prefixes([t[1:-1] for t in texts], b"")
        self.offsets = _Prefixes([b"%d" % c for c in self.chars[:len(base)]])
        self.logprobs = _Prefixes(numbers)
        self.tokens = _Prefixes(texts)
        self.top = _Prefixes([b"{" + t + b":" + p + b"}" for t, p in zip(texts, numbers)])

    def ids_json(self, k: int) -> bytes:
        """The JSON of base[:k] (an echoed prompt that is a prefix of `base`)."""
        return b"[" + self.ids.take(k) + b"]"

    def write_prefix(self, prompt_len: int, n: int) -> bytes:
        """The response to a prompt of base[:prompt_len], replying base[:n] (the ideal client's)."""
        return self.write(self.ids_json(prompt_len), prompt_len, n, ())

    def write(self, prompt_json: bytes, prompt_len: int, n: int, tail: Sequence[int]) -> bytes:
        """The response to a request whose prompt (`prompt_len` ids) was `prompt_json`, replying base[:n] + tail."""
        key = tuple(tail)
        if key not in self.tails:  # a stand-in's endings are a few texts, made once each
            self.tails[key] = ([orjson.dumps(self.pieces[i]) for i in tail], [len(self.pieces[i]) for i in tail],
                               b",".join(b"%d" % i for i in tail))
        texts, lengths, ids = self.tails[key]
        numbers = NUMBERS[n:n + len(tail)]
        offsets = itertools.accumulate(lengths, initial=self.chars[n])
        size = n + len(tail)
        return b"".join((
            b'{"id":"cmpl-sim","object":"text_completion","created":0,"model":"sim","choices":[{"index":0,"text":"',
            self.text.take(n), *(t[1:-1] for t in texts), b'","logprobs":{"text_offset":',
            _list(self.offsets.take(n), b",".join(b"%d" % o for o, _ in zip(offsets, tail))),
            b',"token_logprobs":', _list(self.logprobs.take(n), b",".join(numbers)),
            b',"tokens":', _list(self.tokens.take(n), b",".join(texts)),
            b',"top_logprobs":', _list(self.top.take(n), b",".join(b"{" + t + b":" + p + b"}"
                                                                   for t, p in zip(texts, numbers))),
            b'},"finish_reason":"stop","stop_reason":null,"token_ids":',
            _list(self.ids.take(n), ids),
            b',"prompt_logprobs":null,"prompt_token_ids":', prompt_json,
            b',"routed_experts":null}],"service_tier":null,"system_fingerprint":"vllm-sim","kv_transfer_params":null,'
            b'"metrics":null,"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d,'
            b'"prompt_tokens_details":null,"completion_tokens_details":null}}' % (prompt_len, prompt_len + size, size),
        ))
