"""bench/runner_scale.py --workers: the real runner on N Ray rollout workers against simulated servers that every
worker reaches, beside the zero-overhead client's capacity.

Owns: `SimService` (bench/sim_servers.py's `SimCluster` in a Ray actor of its own, served over TCP: one line of
JSON a request, one a reply), `SimClient` (a worker's connection to it, with the prefix-cache fingerprints the
in-process simulation computes from the prompt), `sim_kit` (what each worker plays with: the real calculator
environment, the SmolLM2 renderer, bench/runner_scale.py's `SimSampler` over a `SimClient`), and
`measure_workers` (one row: tokens/s the servers gave, each process's CPU per turn).
Does not own: the server model (bench/sim_servers.py), the workers (`agent_rl.rollout.ray_pool`, used as a run
uses them), the zero-overhead client and the in-process runner (bench/runner_scale.py).

Design, and what it costs. The simulation must be one: every worker's requests queue on the same servers, under
the same routing (`SimCluster`'s sticky or least-outstanding rule, across all requests). It runs in one Ray actor
(one process, one event loop) that listens on a TCP port; each worker holds one connection to it and multiplexes
its requests by id. Ray's own actor calls cost each side a good part of a turn's CPU (measured:
docs/performance.md#rollout-workers-on-ray): a simulation fed by them would spend more CPU than the runner it
measures. A line of JSON over
a socket costs tens of microseconds a side. What the design costs is reported, not hidden: the simulation
process's CPU per request (`sim_cpu_ms_per_turn`), rank 0's per turn (`driver_cpu_ms_per_turn`: the episodes
sent and their trajectories received in batches, `agent_rl.rollout.ray_pool`), and the workers' (`cpu_ms_per_turn`,
the figure that sizes a deployment). The share is the runner's tokens/s over the zero-overhead client's on
identical servers in one process, as in bench/runner_scale.py: the transport's latency and every process's CPU
count against the workers.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import sys
import time
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ray

from agent_rl.core.config import RayConfig
from agent_rl.core.renderers.choose import load_renderer
from agent_rl.envs.calculator import CalculatorEnv, arithmetic_tasks
from agent_rl.learn.models import resolve_model
from agent_rl.rollout.engine import Episodes, play_groups
from agent_rl.rollout.players import LocalPlayers
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.rollout.worker import Kit, WorkerSettings
from agent_rl.rollout.workers import rollout_workers
from bench.loop_meters import LagMeter
from bench.runner_scale import SimSampler, Workload, calculator_env
from bench.sim_servers import GpuModel, SimCluster


class SimService:
    """The simulated servers in a process of their own, reached over TCP (a Ray actor: Ray places and stops it)."""

    async def start(self, servers: int, gpu: dict[str, Any], routing: str, shared: int) -> tuple[str, int]:
        """Start the cluster and listen; returns (host, port) for the workers."""
        self.cluster = SimCluster(servers, GpuModel(**gpu), routing, shared)
        self.server = await asyncio.start_server(self._serve, "0.0.0.0", 0, limit=2**20)
        return ray.util.get_node_ip_address(), self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def one(rid: int, conv: str, prompt: int, out: int, prints: list[list[int]], tail: int) -> None:
            known = dict((k, fp) for k, fp in prints)
            await self.cluster.generate(conv, prompt, out, check=known.get, tail=tail)
            writer.write(b"%d\n" % rid)

        pending: set[asyncio.Task[None]] = set()
        while line := await reader.readline():
            task = asyncio.ensure_future(one(*json.loads(line)))
            pending.add(task)
            task.add_done_callback(pending.discard)

    async def snapshot(self) -> tuple[tuple[int, int, int, int], float]:
        """(requests, output tokens, prefilled, prompt tokens) so far, and the process's CPU seconds."""
        return self.cluster.snapshot(), time.process_time()


class SimClient:
    """A worker's connection to `SimService`, with `SimCluster.generate`'s signature (bench/runner_scale.py's
    `SimSampler` calls it as it calls the in-process cluster). A conversation is named by the process and the
    sampler's key; the prefix check is sent as the fingerprints of the prompt at each length the conversation's
    earlier turns ended at (the only lengths a server's cache can hold for it)."""

    def __init__(self, address: tuple[str, int]):
        self.address, self.pid = address, os.getpid()
        self.waiting: dict[int, asyncio.Future[None]] = {}
        self.ends: OrderedDict[str, list[int]] = OrderedDict()  # conversation -> where its turns ended
        self.next_id, self.writer = 0, None
        self.lock = asyncio.Lock()

    async def _connect(self) -> asyncio.StreamWriter:
        async with self.lock:
            if self.writer is None:
                reader, self.writer = await asyncio.open_connection(*self.address, limit=2**20)
                asyncio.ensure_future(self._replies(reader))
            return self.writer

    async def _replies(self, reader: asyncio.StreamReader) -> None:
        while line := await reader.readline():
            future = self.waiting.pop(int(line), None)
            if future is not None and not future.done():
                future.set_result(None)

    async def generate(self, conv: Any, prompt_len: int, out_len: int, check: Any = None, tail: int = 0) -> None:
        writer = await self._connect()
        key = f"{self.pid}:{conv}"
        ends = self.ends.pop(key, [])
        prints = [[k, check(k)] for k in ends if k <= prompt_len] if check is not None else []
        rid, self.next_id = self.next_id, self.next_id + 1
        self.waiting[rid] = asyncio.get_running_loop().create_future()
        writer.write(json.dumps([rid, key, prompt_len, out_len, prints, tail]).encode() + b"\n")
        try:
            await asyncio.wait_for(self.waiting[rid], 600)
        finally:
            self.waiting.pop(rid, None)
        self.ends[key] = [*ends, prompt_len + out_len]
        if len(self.ends) > 100_000:
            self.ends.popitem(last=False)


def sim_kit(address: tuple[str, int], model: str, work: dict[str, Any]) -> Kit:
    """A worker's kit: the calculator environment (its calculator where `Workload.calculator` says), the renderer,
    `SimSampler` over the shared simulation."""
    renderer = load_renderer(resolve_model(model))
    shape = Workload(**work)
    return Kit(functools.partial(calculator_env, where=shape.calculator), renderer,
               SimSampler(SimClient(address), renderer, shape, seed=os.getpid()))


class _Here:
    """Rank 0's own sampler, unused: every episode plays on a worker."""

    policy_version = 0


async def _snapshot(sim: Any, sampler: Any) -> dict[str, Any]:
    counts, sim_cpu = await sim.snapshot.remote()
    workers = sampler.stats()
    return {"t": time.monotonic(), "counts": counts, "sim_cpu": sim_cpu, "driver_cpu": time.process_time(),
            "cpu": sum(s["cpu_s"] for s in workers.values()), "turns": sum(s["turns"] for s in workers.values()),
            "up": len(workers)}


async def measure_workers(workers: int, servers: int, concurrency: int, gpu: GpuModel, work: Workload, model: str,
                          warmup: float, window: float, routing: str, shared: int) -> dict[str, float]:
    """The real runner on `workers` Ray workers at one scale: counters over `window` s after `warmup` s."""
    sim = ray.remote(SimService).options(num_cpus=0, max_concurrency=1000).remote()
    address = await sim.start.remote(servers, asdict(gpu), routing, shared)
    settings = WorkerSettings(RayConfig(num_cpus=0, start_timeout_s=600))
    renderer = load_renderer(resolve_model(model))
    limits = EpisodeLimits(max_turns=work.turns + 1, max_tokens_per_turn=1024, max_total_tokens=8192, seed=0)
    tasks = arithmetic_tasks(-(-(concurrency + int(2000 * (warmup + window))) // work.group_size))
    meter = LagMeter()
    try:
        kit = functools.partial(sim_kit, address, model, asdict(work))
        here = _Here()
        async with rollout_workers(workers, kit, here, LocalPlayers(CalculatorEnv, here, renderer),  # type: ignore
                                   settings) as served:
            sampler = served.sampler
            episodes = Episodes(served.players, limits, work.group_size)
            load = asyncio.ensure_future(play_groups(tasks, episodes, concurrency))
            lag = asyncio.ensure_future(meter.run())
            try:
                await asyncio.sleep(warmup)
                first, n_lags = await _snapshot(sim, sampler), len(meter.lags)
                await asyncio.sleep(window)
                last = await _snapshot(sim, sampler)
                if load.done():
                    load.result()  # raises what went wrong, or says the episodes ran out
                    raise RuntimeError("every episode ended before the window did: the figures include the tail")
            finally:
                for task in (load, lag):
                    task.cancel()
                await asyncio.gather(load, lag, return_exceptions=True)
    finally:
        ray.kill(sim)
    return _row(first, last, sorted(meter.lags[n_lags:]), workers)


def _row(first: dict[str, Any], last: dict[str, Any], lags: list[float], workers: int) -> dict[str, float]:
    seconds = last["t"] - first["t"]
    requests, tokens, prefill, prompt = (b - a for a, b in zip(first["counts"], last["counts"]))
    turns = max(last["turns"] - first["turns"], 1)
    return {"workers": workers, "tok_s": tokens / seconds, "turns_s": requests / seconds,
            "cpu_ms_per_turn": 1000 * (last["cpu"] - first["cpu"]) / turns,
            "driver_cpu_ms_per_turn": 1000 * (last["driver_cpu"] - first["driver_cpu"]) / max(requests, 1),
            "sim_cpu_ms_per_turn": 1000 * (last["sim_cpu"] - first["sim_cpu"]) / max(requests, 1),
            "cpu_util": (last["cpu"] - first["cpu"] + last["driver_cpu"] - first["driver_cpu"]
                         + last["sim_cpu"] - first["sim_cpu"]) / seconds,
            "driver_max_lag_ms": 1000 * lags[-1] if lags else 0.0, "prefix_hit": 1 - prefill / max(prompt, 1),
            "window_s": seconds, "workers_up": float(last["up"])}


def workers_bench(args: Any, gpu: GpuModel, work: Workload) -> dict[str, Any]:
    """`--workers`: for each scale, the zero-overhead client's tokens/s in one process (the capacity), then the
    runner on each number of workers; one Ray cluster of this machine for all of it."""
    from agent_rl.rollout.ray_connect import connected
    from bench.runner_scale import measure_side, workload_shape

    root = str(Path(__file__).resolve().parents[1])  # the cluster's processes import bench/ and agent_rl from here
    os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    renderer = load_renderer(resolve_model(args.model))
    shared = workload_shape(renderer)["system"]
    rows = []
    with connected(RayConfig(num_cpus=0), max(args.workers)):
        for servers in args.servers:
            for concurrency in args.concurrency:
                ideal = asyncio.run(measure_side("ideal", servers, concurrency, gpu, work, renderer, args.warmup,
                                                 args.window, args.routing))
                for n in args.workers:
                    got = asyncio.run(measure_workers(n, servers, concurrency, gpu, work, args.model, args.warmup,
                                                      args.window, args.routing, shared))
                    row = {"servers": servers, "concurrency": concurrency, "workers": n,
                           "share": round(got["tok_s"] / ideal["tok_s"], 3), "ideal_tok_s": round(ideal["tok_s"]),
                           **{k: round(v, 3) for k, v in got.items() if k != "workers"}}
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    rows.append(row)
    at_target = [r for r in rows if (r["servers"], r["concurrency"], r["workers"]) == (64, 8192, 4)]
    return {"bench": "runner_scale --workers", "gpu": asdict(gpu), "workload": asdict(work), "routing": args.routing,
            "rows": rows, "cpus": os.cpu_count(), "load_avg_at_start": LOAD_AT_START,
            "target": "share >= 0.95 at 8192 episodes / 64 servers with 4 workers",
            "target_met": bool(at_target) and all(r["share"] >= 0.95 for r in at_target)}


LOAD_AT_START = os.getloadavg()
