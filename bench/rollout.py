"""Rollouts as training samples them: the trained policy as merged weights and as a LoRA adapter, against raw vLLM
generation of the same tokens on the same server, and how much of each turn's prompt the prefix cache saves.

Owns: the sides (`runner_side`: multi-turn rollouts, a 100 ms tool after each turn, through the real runner;
`raw_side`: one request per episode for exactly its sampled tokens; `replay_side`: the rollouts' own requests with
no runner and no tools), a rep of them (`one_rep`), what is read while a side runs (requests in flight: `InFlight`,
`Counted`; the server's counters: `counters`; a side's steady window: `Window`) and the JSON line (`report`).
Does not own: the runner, the sampler, the server and the weight syncs (agent_rl's, as a training run uses them).

One vLLM server (LoRA and dev mode: what a training run starts), one rank-16 adapter (random B, or `--adapter` a
trained one), `--reps` alternations of the sides after a warm-up rep that is not counted; medians of the reps, and
ratios of sides measured in the same rep. What each side does, what the sides share so that a ratio is fair, the
steady windows, the replay and the prefix cache's counters: docs/performance.md#rollouts-against-raw-generation.

    python bench/rollout.py [--model smollm2-135m | --server-url URL] [--adapter DIR] [--reps 2]
        [--episodes 96 --in-flight 48 --server-seqs 32]

(`--server-url`: a server in dev mode with LoRA, started with vLLM's --max-num-seqs equal to `--server-seqs`.)
Prints one JSON line: trained_vs_base (raw_merged / raw_base, target >= 0.9), adapter_vs_base,
rollout_efficiency (rollout_merged / raw_merged, target >= 0.95), rollout_efficiency_adapter,
steady_rollout_efficiency (the same over the steady windows), steady_rollout_efficiency_adapter,
stream_efficiency (rollout_merged / replay_merged), turn_efficiency (replay_merged / raw_merged), ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp

from agent_rl.core.renderers.choose import load_renderer
from agent_rl.core.types import Message
from agent_rl.envs.base import Env, StepResult
from agent_rl.learn.models import resolve_model
from agent_rl.learn.policy import apply_lora, load_causal_lm
from agent_rl.rollout.engine import rollout_groups
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.rollout.serving.choose import serving_backend
from agent_rl.rollout.serving.vllm.sampler import exact_ids
from agent_rl.rollout.serving.vllm.server import VLLMServer, attach
from agent_rl.rollout.weight_sync.adapter import AdapterSync
from agent_rl.rollout.weight_sync.full import FullWeightSync
from agent_rl.rollout.weight_sync.merged import MergedSync


class InFlight:
    """Requests in flight over time: `mean` is their average number since `start`."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.n, self.area, self.requests = 0, 0.0, 0

    def add(self, d: int) -> None:
        now = time.perf_counter()
        self.area += self.n * (now - self.last)
        self.n, self.last, self.requests = self.n + d, now, self.requests + (d > 0)

    @property
    def mean(self) -> float:
        self.add(0)
        return self.area / max(self.last - self.start, 1e-9)


class Counted:
    """A sampler whose requests in flight an `InFlight` counts."""

    def __init__(self, inner, meter: InFlight):
        self.inner, self.meter, self.policy_version = inner, meter, inner.policy_version

    async def sample(self, prompt_ids, params, messages=()):
        self.meter.add(1)
        try:
            return await self.inner.sample(prompt_ids, params, messages)
        finally:
            self.meter.add(-1)


class Window:
    """A side's steady state: the server's own count of generated tokens (vLLM's `generation_tokens` counter) and
    the requests in flight, read when event number `opens_at` and `closes_at` happen (episodes admitted, or
    requests done). Tokens/s and mean batch between the two; None when the side never gets there (`closes_at`
    <= `opens_at`: fewer episodes than the stream holds at once)."""

    def __init__(self, url: str, meter: InFlight, opens_at: int, closes_at: int):
        self.url, self.meter, self.opens_at, self.closes_at = url, meter, opens_at, closes_at
        self.reads: dict[int, asyncio.Task] = {}

    def at(self, event: int) -> None:
        if self.opens_at < self.closes_at and event in (self.opens_at, self.closes_at):
            self.meter.add(0)
            self.reads[event] = asyncio.ensure_future(self._read(self.meter.last, self.meter.area))

    async def _read(self, t: float, area: float) -> tuple[float, float, float, float]:
        """(the read's mid time, generated tokens so far, requests-in-flight area at t, t)"""
        tokens = (await counters(self.url, "generation_tokens"))["generation_tokens"]
        return (t + time.perf_counter()) / 2, tokens, area, t

    async def result(self) -> tuple[float, float] | None:
        """(generated tokens/s, mean requests in flight) over the window."""
        if len(self.reads) < 2:
            return None
        (t0, n0, a0, ta0), (t1, n1, a1, ta1) = await self.reads[self.opens_at], await self.reads[self.closes_at]
        return (n1 - n0) / (t1 - t0), (a1 - a0) / (ta1 - ta0)


async def counters(url: str, *names: str) -> dict[str, float]:
    """The server's counters `names` (tokens, `ServingBackend.counters`), summed over engines."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        read = await serving_backend().counters(http, url)
    return {name: read[name] for name in names}


class SlowToolEnv(Env):
    """Every assistant turn is followed by a tool that takes `tool_s` seconds."""

    def __init__(self, task: dict, turns: int, tool_s: float):
        self.task, self.turns, self.tool_s = task, turns, tool_s

    async def initial_messages(self):
        return [Message("user", f"Tell me a short fact about the number {self.task['n']}.")]

    async def step(self, reply, turn):
        if turn + 1 >= self.turns:
            return StepResult(done=True)
        await asyncio.sleep(self.tool_s)
        return StepResult(messages=(Message("tool", f"fact #{turn}: {self.task['n'] * (turn + 2)}", name="facts"),))

    async def reward(self, messages):
        return 0.0


async def runner_side(sampler, renderer, args, episodes: int, url: str):
    """Rollouts on the sampler's current policy, `args.in_flight` episodes at once: per-episode sampled tokens,
    prompts, seconds, mean requests in flight, and the steady window (`Window`: from the first episode that
    waited for a slot to the last one admitted, while the stream still had episodes to admit)."""
    tasks = [{"id": str(i), "n": i} for i in range(episodes)]
    limits = EpisodeLimits(max_turns=args.turns, max_tokens_per_turn=args.tokens_per_turn,
                           max_total_tokens=4096, temperature=1.0)
    meter = InFlight()
    window = Window(url, meter, opens_at=args.in_flight + 1, closes_at=episodes)
    admitted = 0

    def make_env(task):  # called as each episode starts
        nonlocal admitted
        admitted += 1
        window.at(admitted)
        return SlowToolEnv(task, args.turns, args.tool_ms / 1000)

    groups = await rollout_groups(tasks, make_env, Counted(sampler, meter), renderer, limits, group_size=1,
                                  max_concurrent=args.in_flight)
    dt = time.perf_counter() - meter.start
    trajs = [g.trajectories[0] for g in groups]
    errors = [t.error for t in trajs if t.error]
    if errors:
        raise SystemExit(f"error: rollout failed: {errors[0]}")
    return [t.num_sampled for t in trajs], [list(t.token_ids[: t.prompt_len]) for t in trajs], dt, meter, \
        await window.result(), [turn_plan(t) for t in trajs]


def turn_plan(traj) -> list[tuple[int, list[int]]]:
    """An episode's turns as (tokens sampled, the context ids added after it), in order."""
    if traj.segments:
        raise SystemExit("error: a rollout restarted its context; the replay assumes one segment")
    turns, ids = traj.turns, traj.token_ids
    return [(t.end - t.start, list(ids[t.end: turns[k + 1].start] if k + 1 < len(turns) else ()))
            for k, t in enumerate(turns)]


def raw_session() -> aiohttp.ClientSession:
    """The raw and replay sides' HTTP session: every request at once, the server's queue holds the rest."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1200), connector=aiohttp.TCPConnector(limit=0))


async def raw_side(url, model, prompts, budgets, meter: InFlight | None = None, server_seqs: int = 0):
    """Tokens per second of one request per episode, all at once, each asking for its exact budget (the server
    runs `--server-seqs` of them at a time, the rest wait in its queue); and the steady window (`Window`: from
    the first request done to the moment the queue empties, `server_seqs` requests left)."""
    meter = meter or InFlight()
    window = Window(url, meter, opens_at=1, closes_at=len(prompts) - server_seqs if server_seqs else 0)
    done = 0
    async with raw_session() as http:
        async def one(prompt, n):
            nonlocal done
            meter.add(1)
            try:
                return len(await exact_ids(http, url, model, prompt, n))
            finally:
                meter.add(-1)
                done += 1
                window.at(done)

        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, budgets)))
        return sum(got) / (time.perf_counter() - t0), await window.result()


async def replay_side(url, model, prompts, plans) -> tuple[float, int]:
    """The rollouts' requests with no runner and no tools (module doc): every episode at once, each sending its
    turns back to back, turn t's prompt grown by the ids just generated and the context the rollout added after
    turn t. Sampled tokens/s, and the requests sent."""
    async with raw_session() as http:
        async def lane(prompt, plan):
            made = 0
            for n, context in plan:
                got = await exact_ids(http, url, model, prompt, n)
                made += len(got)
                prompt = [*prompt, *got, *context]
            return made

        t0 = time.perf_counter()
        made = await asyncio.gather(*(lane(p, plan) for p, plan in zip(prompts, plans)))
        return sum(made) / (time.perf_counter() - t0), sum(map(len, plans))


async def rollouts(sampler, renderer, args, url, figures, side: str, episodes: int):
    """One rollout side and its raw generation, with the prefix cache's share of the prompt tokens."""
    cache = ("prefix_cache_queries", "prefix_cache_hits")
    before = await counters(url, *cache)
    budgets, prompts, dt, meter, steady, plans = await runner_side(sampler, renderer, args, episodes, url)
    after = await counters(url, *cache)
    figures[f"rollout_{side}"].append(sum(budgets) / dt)
    raw_meter = InFlight()
    raw, raw_steady = await raw_side(url, sampler.model, prompts, budgets, raw_meter, args.server_seqs)
    figures[f"raw_{side}"].append(raw)
    figures[f"batch_rollout_{side}"].append(meter.mean)
    figures[f"batch_raw_{side}"].append(raw_meter.mean)
    if steady and raw_steady:
        figures[f"steady_rollout_{side}"].append(steady[0])
        figures[f"steady_raw_{side}"].append(raw_steady[0])
        figures[f"steady_batch_rollout_{side}"].append(steady[1])
        figures[f"steady_batch_raw_{side}"].append(raw_steady[1])
    queries, hits = (after[k] - before[k] for k in cache)
    figures[f"cache_hit_{side}"].append(hits / queries if queries else float("nan"))
    figures[f"prefill_{side}"].append((queries - hits) / meter.requests)
    if side == "merged":  # where the rest goes (module doc); the adapter's sides say the same, slower
        before = await counters(url, *cache)
        replay, sent = await replay_side(url, sampler.model, prompts, plans)
        after = await counters(url, *cache)
        queries, hits = (after[k] - before[k] for k in cache)
        figures["replay_merged"].append(replay)
        figures["prefill_replay"].append((queries - hits) / sent)
    return prompts, budgets


async def one_rep(url, renderer, args, policy, base, figures, tmp: Path, rep: int):
    episodes = args.episodes if rep else max(1, args.episodes // 4)  # rep 0 only warms the server up
    async with serving_backend().sampler([url]) as sampler:
        merged = MergedSync(tmp / f"m{rep}", sampler, policy)
        await merged.push(policy, 1)
        prompts, budgets = await rollouts(sampler, renderer, args, url, figures, "merged", episodes)
        adapter = AdapterSync(tmp / f"a{rep}", sampler, prefix=f"bench-{rep}")
        await adapter.push(policy, 1)
        await rollouts(sampler, renderer, args, url, figures, "adapter", episodes)
        await adapter.retire_all()
        await FullWeightSync(tmp / f"b{rep}", sampler, keep=1).push(base, 1)  # the base weights back
        figures["raw_base"].append((await raw_side(url, "base", prompts, budgets))[0])
        merged.close()


def median(xs):
    return round(statistics.median(xs), 3) if xs else None


def ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--server-url")
    ap.add_argument("--adapter", help="a trained peft adapter (default: rank 16 with random B)")
    ap.add_argument("--episodes", type=int, default=96)
    ap.add_argument("--in-flight", type=int, default=48, help="rollout episodes played at once")
    ap.add_argument("--server-seqs", type=int, default=32,
                    help="sequences the server runs at once (--max-num-seqs; 0: the server's default)")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens-per-turn", type=int, default=48)
    ap.add_argument("--tool-ms", type=float, default=100.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--block-size", type=int, help="the server's KV-cache block (default: the server's own)")
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    renderer = load_renderer(model_dir)
    base = load_causal_lm(str(model_dir))
    if args.adapter:
        from peft import PeftModel

        policy = PeftModel.from_pretrained(load_causal_lm(str(model_dir)), args.adapter)
    else:
        policy = apply_lora(load_causal_lm(str(model_dir)), rank=16, alpha=32)
        with __import__("torch").no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    server = None
    url = attach(args.server_url) if args.server_url else None
    if url is None:
        seqs = ("--max-num-seqs", str(args.server_seqs)) if args.server_seqs else ()
        server = VLLMServer(model_dir, kv_cache_gib=2, max_model_len=4096, dev_mode=True,
                            block_size=args.block_size, extra_args=seqs).start()
        url = server.url
    figures: dict[str, list[float]] = {k: [] for k in (
        "rollout_merged", "raw_merged", "rollout_adapter", "raw_adapter", "raw_base", "replay_merged", "prefill_replay",
        "cache_hit_merged", "cache_hit_adapter", "prefill_merged", "prefill_adapter",
        "batch_rollout_merged", "batch_raw_merged", "batch_rollout_adapter", "batch_raw_adapter",
        *(f"steady_{k}_{side}" for k in ("rollout", "raw", "batch_rollout", "batch_raw")
          for side in ("merged", "adapter")))}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
            for rep in range(args.reps + 1):  # rep 0 warms up (compilation, first loads): not counted
                asyncio.run(one_rep(url, renderer, args, policy, base, figures, Path(tmp), rep))
                if rep == 0:
                    figures = {k: [] for k in figures}
    finally:
        if server:
            server.stop()
    report(args, figures)


def report(args, figures) -> None:
    m = {k: median(v) for k, v in figures.items()}
    print(json.dumps({
        "bench": "rollout", "model": args.model, "adapter": args.adapter or "random rank 16",
        "block_size": args.block_size or "server default",
        "episodes": args.episodes, "in_flight": args.in_flight, "server_seqs": args.server_seqs or "server default",
        "turns": args.turns, "tool_ms": args.tool_ms, "reps": args.reps,
        "trained_vs_base": ratio(m["raw_merged"], m["raw_base"]),
        "adapter_vs_base": ratio(m["raw_adapter"], m["raw_base"]),
        "rollout_efficiency": ratio(m["rollout_merged"], m["raw_merged"]),
        "rollout_efficiency_adapter": ratio(m["rollout_adapter"], m["raw_adapter"]),
        "merged_vs_adapter_rollouts": ratio(m["rollout_merged"], m["rollout_adapter"]),
        "prefix_cache_hit_rate": m["cache_hit_merged"], "prefix_cache_hit_rate_adapter": m["cache_hit_adapter"],
        "prefill_tokens_per_turn": m["prefill_merged"], "prefill_tokens_per_turn_adapter": m["prefill_adapter"],
        "rollout_mean_batch": m["batch_rollout_merged"], "raw_mean_batch": m["batch_raw_merged"],
        "rollout_mean_batch_adapter": m["batch_rollout_adapter"], "raw_mean_batch_adapter": m["batch_raw_adapter"],
        "stream_efficiency": ratio(m["rollout_merged"], m["replay_merged"]),
        "turn_efficiency": ratio(m["replay_merged"], m["raw_merged"]),
        "replay_prefill_tokens_per_turn": m["prefill_replay"],
        "reps_stream_efficiency": [ratio(a, b) for a, b in zip(figures["rollout_merged"], figures["replay_merged"])],
        "reps_turn_efficiency": [ratio(a, b) for a, b in zip(figures["replay_merged"], figures["raw_merged"])],
        "steady_rollout_efficiency": ratio(m["steady_rollout_merged"], m["steady_raw_merged"]),
        "steady_rollout_efficiency_adapter": ratio(m["steady_rollout_adapter"], m["steady_raw_adapter"]),
        "steady_rollout_mean_batch": m["steady_batch_rollout_merged"],
        "steady_raw_mean_batch": m["steady_batch_raw_merged"],
        **{f"{k}_tok_s": m[k] for k in ("steady_rollout_merged", "steady_raw_merged", "steady_rollout_adapter",
                                        "steady_raw_adapter")},
        "reps_steady_rollout_efficiency": [ratio(a, b) for a, b in zip(figures["steady_rollout_merged"],
                                                                       figures["steady_raw_merged"])],
        **{f"{k}_tok_s": m[k] for k in ("raw_base", "raw_merged", "raw_adapter", "rollout_merged", "rollout_adapter",
                                        "replay_merged")},
        "reps_tok_s": {k: [round(x, 1) for x in v] for k, v in figures.items()
                       if not k.startswith(("cache", "prefill", "batch", "steady"))},
        "reps_rollout_efficiency": [ratio(a, b) for a, b in zip(figures["rollout_merged"], figures["raw_merged"])],
    }))


if __name__ == "__main__":
    main()
