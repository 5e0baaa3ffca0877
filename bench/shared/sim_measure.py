"""One side measured against the simulated servers: the real runner or a zero-overhead client, at one scale, over a
window after a warm-up, with what the process reads of itself meanwhile.

Owns: the two loads (`runner_load`: calculator episodes played by `rollout_groups`; `ideal_load`: lanes of the same
lengths with no tokenizer, env or tool), `measure_side` (tokens/s, CPU per turn, the servers' work, lag, prefix
hits, garbage collections over the window), `episodes_needed`, `INSTANT` (servers that answer at once), and the
meters: the event loop's lag (`LagMeter`), garbage collections (`CollectionTimes`), page faults, and the time the
loop's thread waited for a CPU (`run_queue_s`).
Does not own: the servers (`sim_servers`), the sampler and workload (`sim_episodes`), what a bench compares
(bench/runner_scale.py, bench/turn_parts.py).
"""

from __future__ import annotations

import asyncio
import gc
import math
import random
import resource
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent_rl.core.renderers.base import Renderer
from agent_rl.envs.calculator import CalculatorEnv, arithmetic_tasks
from agent_rl.rollout.engine import rollout_groups
from agent_rl.rollout.quiet_gc import ROLLOUT_GC
from agent_rl.rollout.runner import EpisodeLimits
from bench.shared.sim_episodes import FILLER, SimSampler, Workload, calculator_env, workload_shape
from bench.shared.sim_responses import Responses, ServerWork, token_pieces
from bench.shared.sim_servers import GpuModel, SimCluster

INSTANT = GpuModel(step_base_s=1e-9, step_per_seq_s=0.0, prefill_tok_s=1e15, max_seqs=10**6, overhead_s=0.0)


class CollectionTimes:
    """A `gc.callbacks` hook: when each garbage collection started (loop clock) and how long it took."""

    def __init__(self):
        self.times: list[tuple[float, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.monotonic()
        else:
            self.times.append((self._start, time.monotonic() - self._start))

    def longest(self, since: float, until: float) -> float:
        return max((d for t, d in self.times if since <= t < until), default=0.0)


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


def page_faults() -> int:
    """The process's page faults so far (minor: a page first touched, or mapped again after it was given back)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def run_queue_s() -> float:
    """Seconds the event loop's thread has waited for a CPU (Linux schedstat): how loaded the machine is."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


async def runner_load(cluster: SimCluster, renderer: Renderer, work: Workload, concurrency: int,
                      episodes: int, started: list[int], server: ServerWork) -> None:
    """The real runner: `episodes` calculator episodes, `concurrency` at a time."""
    sampler = SimSampler(cluster, renderer, work, server=server)

    def make_env(task: dict[str, Any]) -> CalculatorEnv:
        started[0] += 1
        return calculator_env(task, work.calculator)

    limits = EpisodeLimits(max_turns=work.turns + 1, max_tokens_per_turn=1024, max_total_tokens=8192, seed=0)
    tasks = arithmetic_tasks(-(-episodes // work.group_size))
    sampler.prepare(tasks)
    groups = await rollout_groups(tasks, make_env, sampler, renderer, limits, work.group_size, concurrency)
    errors = [t.error for g in groups for t in g.trajectories if t.error]
    if errors:
        raise RuntimeError(f"{len(errors)} episodes failed, e.g. {errors[0]}")


async def ideal_load(cluster: SimCluster, work: Workload, concurrency: int, shape: dict[str, int],
                     started: list[int], text_ids: list[int], pieces: Sequence[str], server: ServerWork,
                     seed: int = 1) -> None:
    """A client with no cost at all: `concurrency` lanes, each playing episodes of the same lengths
    back to back (no tokenizer, no environment, no tool between the turns). Each turn the servers' response
    JSON is written, as the runner's side writes it, of ids of real text (`text_ids`: as many as a context has;
    `pieces`: each id's text, `token_pieces`)."""
    rng, responses = random.Random(seed), Responses(text_ids, pieces)

    async def lane() -> None:
        while True:
            started[0] += 1
            conv, prompt = object(), shape["prompt"]
            for turn in range(work.turns):
                out = server.timed(rng.randint, work.min_tokens, work.max_tokens)  # the servers' work, as the
                out += shape["call"] if turn < work.turns - 1 else shape["answer"]  # runner's side times it
                await cluster.generate(conv, prompt, out)
                server.timed(responses.write_prefix, prompt, out)  # the server's work, which the runner's side
                # pays too
                prompt += out + shape["continuation"]

    with ROLLOUT_GC.quiet():  # as the runner plays its episodes: the collections it does not make are not counted
        await asyncio.gather(*(lane() for _ in range(concurrency)))


def episodes_needed(servers: int, concurrency: int, gpu: GpuModel, work: Workload, seconds: float) -> int:
    """Enough episodes for the runner to stay at full concurrency for `seconds`: 1.5x the servers' rate,
    at most 2,000 a second (more than one event loop starts here; the bench says so if it runs dry)."""
    batch = max(1, min(gpu.max_seqs, concurrency // servers))
    tokens = (work.min_tokens + work.max_tokens) / 2 + 30
    turn_s = gpu.overhead_s + tokens * gpu.step_s(batch)
    rate = min(concurrency / turn_s, servers * batch / gpu.step_s(batch) / tokens) / work.turns
    return int(concurrency + min(1.5 * rate, 2000) * seconds)


async def measure_side(side: str, servers: int, concurrency: int, gpu: GpuModel, work: Workload,
                       renderer: Renderer, warmup: float, window: float, routing: str) -> dict[str, float]:
    """One side ("runner" or "ideal") at one scale: counters over `window` s after `warmup` s."""
    loop = asyncio.get_running_loop()
    shape = workload_shape(renderer)
    cluster, started, meter = SimCluster(servers, gpu, routing, shape["system"]), [0], LagMeter()
    episodes = episodes_needed(servers, concurrency, gpu, work, warmup + window)
    server = ServerWork()
    load = (runner_load(cluster, renderer, work, concurrency, episodes, started, server) if side == "runner"
            else ideal_load(cluster, work, concurrency, shape, started, renderer.encode(FILLER * 600),
                            token_pieces(renderer), server))
    tasks = [asyncio.create_task(load), asyncio.create_task(meter.run())]
    collections = CollectionTimes()
    gc.callbacks.append(collections)
    try:
        await asyncio.sleep(warmup)
        first, cpu0, wait0, t0, n_lags, faults0 = (cluster.snapshot(), time.process_time(), run_queue_s(),
                                                   loop.time(), len(meter.lags), page_faults())
        work0 = server.seconds
        await asyncio.sleep(window)
        last, cpu1, wait1, t1 = cluster.snapshot(), time.process_time(), run_queue_s(), loop.time()
        faults1, work1 = page_faults(), server.seconds
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
        gc.callbacks.remove(collections)
    seconds, cpu = t1 - t0, cpu1 - cpu0
    requests, tokens, prefill, prompt = (b - a for a, b in zip(first, last))
    return {"tok_s": tokens / seconds, "turns_s": requests / seconds, "cpu_util": cpu / seconds,
            "cpu_ms_per_turn": 1000 * cpu / max(requests, 1), "faults_per_turn": (faults1 - faults0) / max(requests, 1),
            "server_work_ms_per_turn": 1000 * (work1 - work0) / max(requests, 1),
            "max_lag_ms": 1000 * lags[-1] if lags else 0.0,
            "p99_lag_ms": 1000 * lags[int(0.99 * (len(lags) - 1))] if lags else 0.0,
            "prefix_hit": 1 - prefill / max(prompt, 1), "window_s": seconds, "cpu_wait": (wait1 - wait0) / seconds,
            "gc_in_window_ms": 1000 * collections.longest(t0, t1),
            "gc_after_ms": 1000 * collections.longest(t1, math.inf)}
