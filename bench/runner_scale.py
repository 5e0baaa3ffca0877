"""Runner at scale: the real async runner against simulated GPU servers, 256 to 8,192 episodes at once.

Owns: a latency model of vLLM servers (`GpuModel`, `SimServer`, `SimCluster`), a sampler that
answers through it with real token ids (`SimSampler`), a zero-overhead client of the same servers
(`ideal_load`), and the measurement of both side by side (`measure_pair`).
Does not own: the runner, the renderer, the environment or the tool: those are the real ones
(`rollout_groups`, the SmolLM2 ChatML renderer, `envs.calculator` with its `calculator` tool).

What runs for real: every episode is a `CalculatorEnv` played by `rollout_groups`; each reply is
real token ids (filler "thinking" + a `<tool_call>` or an `<answer>`) that the runner parses, the
env dispatches to the real tool, and the renderer continues; the sampler also does VLLMSampler's
client-side work (JSON body of the prompt ids, `_completion`'s checks), not the socket I/O.
What is simulated: the GPU servers. Each is a continuous-batching engine in closed form: all
running sequences advance one token per decode step, a step takes `step_base + step_per_seq *
batch` seconds, prefill of the prompt tokens not in the server's prefix cache stalls decoding for
`tokens / prefill_tok_s`, at most `max_seqs` run at once (the rest wait), and a request pays
`overhead` of latency (HTTP, scheduling) outside the GPU. Requests go to the server with the fewest
outstanding requests, ties at random, as VLLMSampler routes them. Time is real time.

Assumed numbers (a 7-8B model in bf16 on one H100 SXM with vLLM; change them with the flags):
- step_base 7 ms: decode at batch 1 is memory-bound, 16 GB of weights / 3.35 TB/s = 4.8 ms;
  LambdaLabsML/vllm-benchmark measured a median TPOT of 7.6 ms for Llama-3-8B-Instruct on 1xH100.
- step_per_seq 0.053 ms: puts a full batch of 256 at 20.5 ms a step, 12,500 output tok/s, the
  ~12.5k tok/s third-party benchmarks report for Llama-3.1-8B bf16 on 1xH100 with vLLM.
- prefill 30,000 tok/s: 2 x 8e9 FLOP a token against 989 TFLOP/s dense bf16 at ~50% utilisation.
- max_seqs 256: vLLM's max_num_seqs below H100 size (1,024 on an H100 is KV-bound anyway: 128 KiB
  of KV a token for Llama-3-8B, ~50 GB free, ~400k tokens, i.e. ~300 sequences of ~1.3k tokens).
- overhead 5 ms a request; prefix cache: the last context of each conversation a server served,
  LRU over 400k tokens (least-outstanding routing moves conversations between servers: misses).

Share: the runner's sampled tokens/s over what a zero-overhead client (`ideal_load`: the same
episodes' lengths, no tokenizer, no env, no tool) gets from identical servers at the same
concurrency, both measured over the same window after a warm-up. Target: >= 0.95 and an event-loop
lag under 50 ms at 4,096 concurrent episodes.

    python bench/runner_scale.py [--servers 8 64] [--concurrency 256 1024 4096 8192] [--window 20]
(progress on stderr, one JSON line on stdout)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import heapq
import itertools
import json
import random
import resource
import sys
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_rl.core.renderer import Renderer  # noqa: E402
from agent_rl.core.renderers import load_renderer  # noqa: E402
from agent_rl.core.types import Message, ToolCall  # noqa: E402
from agent_rl.learn.models import resolve_model  # noqa: E402
from agent_rl.rollout.runner import EpisodeLimits, rollout_groups  # noqa: E402
from agent_rl.rollout.sampler import Completion, SamplingParams, _completion  # noqa: E402
from envs.calculator import SYSTEM, CalculatorEnv, arithmetic_tasks  # noqa: E402

FILLER = ("Let me think about this step by step. First I read the question again, then I decide which "
          "tool helps, what arguments it needs, and how I will check the result before I answer. ")


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


@dataclass(frozen=True)
class Workload:
    """Episode shape: `turns` replies (all but the last call the calculator), filler tokens per reply."""

    turns: int = 3
    min_tokens: int = 96
    max_tokens: int = 416
    group_size: int = 8


class SimServer:
    """Continuous batching in closed form: progress is a decode-step counter `k` that grows at
    1 / step_s(batch) per second; a request admitted at step k with n tokens ends at step k + n.
    One timer per server, for its next completion; prefill pushes the counter's clock forward."""

    def __init__(self, gpu: GpuModel, loop: asyncio.AbstractEventLoop):
        self.gpu, self.loop = gpu, loop
        self.k, self.t = 0.0, loop.time()
        self.running: list[tuple[float, int, asyncio.Future]] = []
        self.waiting: deque[tuple[int, int, asyncio.Future]] = deque()
        self.timer: asyncio.TimerHandle | None = None
        self.outstanding = 0
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
        self.timer is not None and self.timer.cancel()


class SimCluster:
    """N servers, least-outstanding routing (VLLMSampler's rule), and what they served."""

    def __init__(self, n: int, gpu: GpuModel, seed: int = 0):
        loop = asyncio.get_running_loop()
        self.servers = [SimServer(gpu, loop) for _ in range(n)]
        self.rng = random.Random(seed)
        self.requests = self.tokens = self.prefill = self.prompt_tokens = 0

    def pick(self) -> SimServer:
        low = min(s.outstanding for s in self.servers)
        return self.rng.choice([s for s in self.servers if s.outstanding == low])

    async def generate(self, conv: Any, prompt_len: int, out_len: int, check: Any = None, tail: int = 0) -> None:
        """Serve one request of conversation `conv`; its context (prompt + output, whose last ids
        fingerprint to `tail`) stays in that server's prefix cache for the conversation's next turn."""
        server = self.pick()
        server.outstanding += 1
        try:
            await asyncio.sleep(server.gpu.overhead_s)
            known = server.cached_prefix(conv, prompt_len, check) if conv is not None else 0
            await server.submit(prompt_len - known, out_len)
            if conv is not None:
                server.remember(conv, prompt_len + out_len, tail)
        finally:
            server.outstanding -= 1
        self.requests += 1
        self.tokens += out_len
        self.prefill += prompt_len - known
        self.prompt_tokens += prompt_len

    def snapshot(self) -> tuple[int, int, int, int]:
        return self.requests, self.tokens, self.prefill, self.prompt_tokens

    def close(self) -> None:
        for s in self.servers:
            s.close()


class SimSampler:
    """A `Sampler` whose replies are real token ids and whose timing comes from a `SimCluster`.

    Turn t of an episode (t = assistant messages so far): filler tokens, then a calculator call on
    the question's expression, or, on the last turn, `<answer>{last tool result}</answer>`."""

    def __init__(self, cluster: SimCluster, renderer: Renderer, work: Workload, seed: int = 0):
        self.cluster, self.renderer, self.work = cluster, renderer, work
        self.rng = random.Random(seed)
        self.policy_version = 0
        self.filler = renderer.encode(FILLER * (work.max_tokens // 20 + 1))[: work.max_tokens]
        self.stop = renderer.stop_token_ids[0]

    def reply_ids(self, messages: Sequence[Message]) -> list[int]:
        turn = sum(1 for m in messages if m.role == "assistant")
        n = self.rng.randint(self.work.min_tokens, self.work.max_tokens)
        if turn < self.work.turns - 1:
            question = next(m.content for m in messages if m.role == "user")
            expression = question.removeprefix("What is ").removesuffix("?")
            tail = "\n" + self.renderer.format_reply("", (ToolCall("calculator", {"expression": expression}),))
        else:
            tail = f"\n<answer>{messages[-1].content.strip()}</answer>"
        return [*self.filler[:n], *self.renderer.encode(tail), self.stop]

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
                     messages: Sequence[Message] = ()) -> Completion:
        ids = self.reply_ids(messages)
        json.dumps({"model": "sim", "prompt": list(prompt_ids), "max_tokens": params.max_tokens,
                    "stop_token_ids": list(params.stop_token_ids), "seed": params.seed})  # VLLMSampler's body
        conv = id(messages[0]) if messages else None  # the episode's first message object, one per episode
        await self.cluster.generate(conv, len(prompt_ids), len(ids), check=lambda n: hash(tuple(prompt_ids[n - 16:n])),
                                    tail=hash(tuple(ids[-16:])))
        data = {"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": [-0.5] * len(ids)},
                             "finish_reason": "stop", "prompt_token_ids": prompt_ids}]}
        return _completion(data, prompt_ids, self.policy_version, "sim")


class LagMeter:
    """How late a task that asks to wake every `period` s wakes: the event loop's lag."""

    def __init__(self, period: float = 0.01):
        self.period, self.lags = period, []

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.period)
            self.lags.append(loop.time() - t - self.period)


def workload_shape(renderer: Renderer) -> dict[str, int]:
    """Token counts of a calculator episode's pieces: the ideal client's prompt and reply lengths."""
    task = arithmetic_tasks(3)[2]
    env = CalculatorEnv(task)
    call = renderer.format_reply("", (ToolCall("calculator", {"expression": task["expression"]}),))
    return {"prompt": len(renderer.render([Message("system", SYSTEM), Message("user", task["question"])],
                                          env.tool_schemas)),
            "call": len(renderer.encode("\n" + call)) + 1,
            "answer": len(renderer.encode(f"\n<answer>{task['answer']}</answer>")) + 1,
            "continuation": len(renderer.continuation([Message("tool", str(task["answer"]), name="calculator")]))}


async def runner_load(cluster: SimCluster, renderer: Renderer, work: Workload, concurrency: int,
                      episodes: int, started: list[int]) -> None:
    """The real runner: `episodes` calculator episodes, `concurrency` at a time."""
    sampler = SimSampler(cluster, renderer, work)

    def make_env(task: dict[str, Any]) -> CalculatorEnv:
        started[0] += 1
        return CalculatorEnv(task)

    limits = EpisodeLimits(max_turns=work.turns + 1, max_tokens_per_turn=1024, max_total_tokens=8192, seed=0)
    tasks = arithmetic_tasks(-(-episodes // work.group_size))
    groups = await rollout_groups(tasks, make_env, sampler, renderer, limits, work.group_size, concurrency)
    errors = [t.error for g in groups for t in g.trajectories if t.error]
    if errors:
        raise RuntimeError(f"{len(errors)} episodes failed, e.g. {errors[0]}")


async def ideal_load(cluster: SimCluster, work: Workload, concurrency: int, shape: dict[str, int],
                     started: list[int], seed: int = 1) -> None:
    """A client with no cost at all: `concurrency` lanes, each playing episodes of the same lengths
    back to back (no tokenizer, no environment, no tool between the turns)."""
    rng = random.Random(seed)

    async def lane() -> None:
        while True:
            started[0] += 1
            conv, prompt = object(), shape["prompt"]
            for turn in range(work.turns):
                out = rng.randint(work.min_tokens, work.max_tokens)
                out += shape["call"] if turn < work.turns - 1 else shape["answer"]
                await cluster.generate(conv, prompt, out)
                prompt += out + shape["continuation"]

    await asyncio.gather(*(lane() for _ in range(concurrency)))


def run_queue_s() -> float:
    """Seconds the event loop's thread has waited for a CPU (Linux schedstat): how loaded the machine is."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def episodes_needed(servers: int, concurrency: int, gpu: GpuModel, work: Workload, seconds: float) -> int:
    """Enough episodes for the runner to stay at full concurrency for `seconds` (1.5x the model's rate)."""
    batch = max(1, min(gpu.max_seqs, concurrency // servers))
    tokens = (work.min_tokens + work.max_tokens) / 2 + 30
    turn_s = gpu.overhead_s + tokens * gpu.step_s(batch)
    rate = min(concurrency / turn_s, servers * batch / gpu.step_s(batch) / tokens) / work.turns
    return int(concurrency + 1.5 * rate * seconds)


async def measure_side(side: str, servers: int, concurrency: int, gpu: GpuModel, work: Workload,
                       renderer: Renderer, warmup: float, window: float) -> dict[str, float]:
    """One side ("runner" or "ideal") at one scale: counters over `window` s after `warmup` s."""
    loop = asyncio.get_running_loop()
    cluster, started, meter = SimCluster(servers, gpu), [0], LagMeter()
    episodes = episodes_needed(servers, concurrency, gpu, work, warmup + window)
    load = (runner_load(cluster, renderer, work, concurrency, episodes, started) if side == "runner"
            else ideal_load(cluster, work, concurrency, workload_shape(renderer), started))
    tasks = [asyncio.create_task(load), asyncio.create_task(meter.run())]
    try:
        await asyncio.sleep(warmup)
        first, cpu0, wait0, t0, n_lags = cluster.snapshot(), time.process_time(), run_queue_s(), loop.time(), len(meter.lags)
        await asyncio.sleep(window)
        last, cpu1, wait1, t1 = cluster.snapshot(), time.process_time(), run_queue_s(), loop.time()
        lags = sorted(meter.lags[n_lags:])
        if tasks[0].done():
            tasks[0].result()  # raises what went wrong
        if side == "runner" and started[0] >= episodes:
            raise RuntimeError(f"all {episodes} episodes started before the window ended: the figures include the tail")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        cluster.close()
    seconds, cpu = t1 - t0, cpu1 - cpu0
    requests, tokens, prefill, prompt = (b - a for a, b in zip(first, last))
    return {"tok_s": tokens / seconds, "turns_s": requests / seconds, "cpu_util": cpu / seconds,
            "cpu_ms_per_turn": 1000 * cpu / max(requests, 1), "max_lag_ms": 1000 * lags[-1] if lags else 0.0,
            "p99_lag_ms": 1000 * lags[int(0.99 * (len(lags) - 1))] if lags else 0.0,
            "prefix_hit": 1 - prefill / max(prompt, 1), "window_s": seconds, "cpu_wait": (wait1 - wait0) / seconds}


async def measure_pair(servers: int, concurrency: int, gpu: GpuModel, work: Workload, renderer: Renderer,
                       warmup: float, window: float) -> dict[str, Any]:
    """The runner and the ideal client at the same scale, one after the other; the runner's share."""
    runner = await measure_side("runner", servers, concurrency, gpu, work, renderer, warmup, window)
    gc.collect()
    ideal = await measure_side("ideal", servers, concurrency, gpu, work, renderer, warmup, window)
    gc.collect()
    r = lambda x: round(x, 3)  # noqa: E731
    return {"servers": servers, "concurrency": concurrency, "share": r(runner["tok_s"] / ideal["tok_s"]),
            "max_lag_ms": r(runner["max_lag_ms"]), "p99_lag_ms": r(runner["p99_lag_ms"]),
            "runner_tok_s": round(runner["tok_s"]), "ideal_tok_s": round(ideal["tok_s"]),
            "share_of_peak": r(runner["tok_s"] / (servers * gpu.peak_tok_s)), "turns_s": round(runner["turns_s"], 1),
            "cpu_util": r(runner["cpu_util"]), "cpu_ms_per_turn": r(runner["cpu_ms_per_turn"]),
            "ideal_cpu_ms_per_turn": r(ideal["cpu_ms_per_turn"]), "ideal_max_lag_ms": r(ideal["max_lag_ms"]),
            "prefix_hit": r(runner["prefix_hit"]), "ideal_prefix_hit": r(ideal["prefix_hit"]),
            "cpu_wait": r(runner["cpu_wait"]), "window_s": r(runner["window_s"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[256, 1024, 4096, 8192])
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds before the window")
    ap.add_argument("--window", type=float, default=20.0, help="seconds measured, per side")
    ap.add_argument("--model", default="smollm2-135m", help="whose tokenizer renders the episodes")
    for name, value in asdict(GpuModel()).items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = ap.parse_args()
    gpu = GpuModel(**{k: getattr(args, k) for k in asdict(GpuModel())})
    work = Workload()
    renderer = load_renderer(resolve_model(args.model))
    rows = []
    for servers in args.servers:
        for concurrency in args.concurrency:
            row = asyncio.run(measure_pair(servers, concurrency, gpu, work, renderer, args.warmup, args.window))
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    at_target = [row for row in rows if row["concurrency"] == 4096]
    print(json.dumps({
        "bench": "runner_scale", "gpu": asdict(gpu), "peak_tok_s_per_server": round(gpu.peak_tok_s),
        "workload": asdict(work), "rows": rows, "target": "share >= 0.95 and max_lag_ms < 50 at 4096 episodes",
        "target_met": bool(at_target) and all(x["share"] >= 0.95 and x["max_lag_ms"] < 50 for x in at_target),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }))


if __name__ == "__main__":
    main()
