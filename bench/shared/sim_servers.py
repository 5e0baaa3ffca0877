"""Simulated GPU inference servers: a latency model of vLLM engines behind a router, in real time.

Owns: `GpuModel` (one server's numbers), `SimServer` (continuous batching in closed form, with a
prefix cache) and `SimCluster` (N servers, least-outstanding or sticky routing, what they served and
how long each had work).
Does not own: what is asked of them (`sim_measure`: the real runner and a zero-overhead client; `sim_remote`: the
same servers for Ray workers), token ids (callers bring their own), HTTP.

The model: all running sequences advance one token per decode step; a step takes `step_base +
step_per_seq * batch` seconds; prefill of the prompt tokens not in the server's prefix cache stalls
decoding for `tokens / prefill_tok_s`; at most `max_seqs` run at once, the rest wait in order; a
request also pays `overhead` of latency outside the GPU (HTTP, scheduling). Time is the event loop's
clock, so a simulated second is a real one and the client's CPU cost and lag are real too. Progress
is computed from time, not from timers: a late timer delays a reply, never the server's work.

Assumed numbers (a 7-8B model in bf16 on one H100 SXM with vLLM; bench/runner_scale.py's and bench/async_sim.py's
flags change them):
- step_base 7 ms: decode at batch 1 is memory-bound, 16 GB of weights / 3.35 TB/s = 4.8 ms;
  LambdaLabsML/vllm-benchmark measured a median TPOT of 7.6 ms for Llama-3-8B-Instruct on 1xH100.
- step_per_seq 0.053 ms: puts a full batch of 256 at 20.5 ms a step, 12,500 output tok/s, the
  ~12.5k tok/s third-party benchmarks report for Llama-3.1-8B bf16 on 1xH100 with vLLM.
- prefill 30,000 tok/s: 2 x 8e9 FLOP a token against 989 TFLOP/s dense bf16 at ~50% utilisation.
- max_seqs 256: vLLM's max_num_seqs below H100 size (1,024 on an H100 is KV-bound anyway: 128 KiB
  of KV a token for Llama-3-8B, ~50 GB free, ~400k tokens, i.e. ~300 sequences of ~1.3k tokens).
- overhead 5 ms a request (assumed); prefix cache: each conversation's last context on the server
  that served it, LRU over 400k tokens, plus the system prompt every episode shares.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GpuModel:
    """One simulated GPU server (defaults: a 7-8B model in bf16 on an H100, see the module docstring)."""

    step_base_s: float = 0.007
    step_per_seq_s: float = 0.0000527
    prefill_tok_s: float = 30_000.0
    max_seqs: int = 256
    overhead_s: float = 0.005
    cache_tokens: int = 400_000

    def step_s(self, batch: int) -> float:
        return self.step_base_s + self.step_per_seq_s * batch

    @property
    def peak_tok_s(self) -> float:
        """Output tokens/s of a full batch with no prefill: the most one server can give."""
        return self.max_seqs / self.step_s(self.max_seqs)


class SimServer:
    """Continuous batching in closed form: progress is a decode-step counter `k` that grows at
    1 / step_s(batch) per second; a request admitted at step k with n tokens ends at step k + n.
    One timer per server, for its next completion; prefill pushes the counter's clock forward."""

    def __init__(self, gpu: GpuModel, loop: asyncio.AbstractEventLoop):
        self.gpu, self.loop = gpu, loop
        self.k, self.t = 0.0, loop.time()
        self.busy_s, self.seen = 0.0, loop.time()  # seconds with a sequence running or prefilling, until `seen`
        self.running: list[tuple[float, int, asyncio.Future]] = []
        self.waiting: deque[tuple[int, int, asyncio.Future]] = deque()
        self.timer: asyncio.TimerHandle | None = None
        self.cache: OrderedDict[Any, tuple[int, int]] = OrderedDict()  # conversation -> (length, fingerprint)
        self.cached = 0
        self.seq = itertools.count()

    def submit(self, new_tokens: int, out_tokens: int) -> asyncio.Future:
        fut = self.loop.create_future()
        self.waiting.append((new_tokens, out_tokens, fut))
        self.update()
        return fut

    def update(self) -> None:
        now, gpu, running = self.loop.time(), self.gpu, self.running
        if running:  # the set of running sequences changes only here: busy since the last update
            self.busy_s += now - self.seen
        self.seen = now
        if now > self.t:
            if running:
                self.k += (now - self.t) / gpu.step_s(len(running))
            self.t = now
        while running and running[0][0] <= self.k + 1e-6:
            fut = heapq.heappop(running)[2]
            if not fut.done():
                fut.set_result(None)
        while self.waiting and len(running) < gpu.max_seqs:
            new, out, fut = self.waiting.popleft()
            if fut.done():
                continue  # cancelled while waiting
            self.t = max(self.t, now) + new / gpu.prefill_tok_s  # prefill stalls decoding
            heapq.heappush(running, (self.k + out, next(self.seq), fut))
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if running:
            when = self.t + (running[0][0] - self.k) * gpu.step_s(len(running))
            self.timer = self.loop.call_at(when, self.update)

    def cached_prefix(self, conv: Any, prompt_len: int, check: Any) -> int:
        """Tokens of this prompt in the prefix cache: the conversation's last context on this server,
        if the prompt still starts with it (`check(n)` fingerprints the prompt's first n tokens)."""
        hit = self.cache.get(conv)
        if hit is None or hit[0] > prompt_len or (check is not None and check(hit[0]) != hit[1]):
            return 0
        self.cache.move_to_end(conv)
        return hit[0]

    def remember(self, conv: Any, length: int, fingerprint: int) -> None:
        old = self.cache.pop(conv, None)
        self.cached += length - (old[0] if old else 0)
        self.cache[conv] = (length, fingerprint)
        while self.cached > self.gpu.cache_tokens:
            self.cached -= self.cache.popitem(last=False)[1][0]

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


class SimCluster:
    """N servers, their router, and what they served. Routing "least": the server with the fewest
    outstanding requests, ties at random (VLLMSampler's rule). "sticky": the server that served the
    conversation's last turn while it has at most ~1/8 more outstanding than the least loaded (a
    prefix-aware router), else "least". Every server also holds the `shared` system-prompt prefix."""

    def __init__(self, n: int, gpu: GpuModel, routing: str = "sticky", shared: int = 0, seed: int = 0):
        loop = asyncio.get_running_loop()
        self.servers = [SimServer(gpu, loop) for _ in range(n)]
        self.load = [0] * n  # outstanding requests of each server: a list, so that its minimum is one C call
        self.sticky, self.shared, self.rng = routing == "sticky", shared, random.Random(seed)
        self.home: OrderedDict[Any, int] = OrderedDict()  # conversation -> its last server
        self.requests = self.tokens = self.prefill = self.prompt_tokens = 0

    def pick(self, conv: Any) -> int:
        """The index of the server for the conversation's next request."""
        load = self.load
        low = min(load)
        home = self.home.get(conv) if self.sticky else None
        if home is not None and load[home] <= low + 1 + low // 8:
            return home
        return self.rng.choice([i for i, n in enumerate(load) if n == low])

    async def generate(self, conv: Any, prompt_len: int, out_len: int, check: Any = None, tail: int = 0) -> None:
        """Serve one request of conversation `conv`; its context (prompt + output, whose last ids
        fingerprint to `tail`) stays in that server's prefix cache for the conversation's next turn."""
        index = self.pick(conv)
        server = self.servers[index]
        self.load[index] += 1
        try:
            await asyncio.sleep(server.gpu.overhead_s)
            known = server.cached_prefix(conv, prompt_len, check) if conv is not None else 0
            known = max(known, min(self.shared, prompt_len))
            await server.submit(prompt_len - known, out_len)
            if conv is not None:
                server.remember(conv, prompt_len + out_len, tail)
                self.home[conv] = index
                self.home.move_to_end(conv)
                if len(self.home) > 100_000:
                    self.home.popitem(last=False)
        finally:
            self.load[index] -= 1
        self.requests += 1
        self.tokens += out_len
        self.prefill += prompt_len - known
        self.prompt_tokens += prompt_len

    def snapshot(self) -> tuple[int, int, int, int]:
        return self.requests, self.tokens, self.prefill, self.prompt_tokens

    def busy_s(self) -> float:
        """Server-seconds with work (a sequence decoding or prefilling), summed over the servers, until now."""
        for s in self.servers:
            s.update()
        return sum(s.busy_s for s in self.servers)

    def close(self) -> None:
        for s in self.servers:
            s.close()


