"""Runner at scale: the real async runner against simulated GPU servers, 256 to 16,384 episodes at once, side by side
with a zero-overhead client of identical servers.

Owns: the comparison at each scale (`measure_pair`: the runner's share of the ideal client's tokens/s, its event
loop's lag, its own CPU per turn), the ceiling (`measure_ceiling`: servers that answer at once), the runner alone
(`--runner-only`) and on Ray rollout workers (`--workers`: `measure_workers`, `workers_bench`), and the JSON line.
Does not own: the simulation and one side's measurement (bench/shared/: `sim_servers`, `sim_episodes`,
`sim_measure`, `sim_remote`); the runner, renderer, calculator environment and tool are the real ones.

What runs for real, what each figure means (`share`, `own_cpu_ms_per_turn`, `server_work_ms_per_turn`, the lags,
`gc_in_window_ms` / `gc_after_ms`), why routing is "sticky" by default (`--routing least`: VLLMSampler's rule), and
what it has measured: docs/performance.md#the-runner-at-scale-by-simulation (`--workers`: #rollout-workers-on-ray).

    python bench/runner_scale.py [--servers 8 64] [--concurrency 256 1024 4096 8192] [--routing least]
    python bench/runner_scale.py --workers 1 2 4 --servers 64 128 --concurrency 8192 16384  (Ray rollout workers)
    python bench/runner_scale.py --runner-only --servers 64 --concurrency 4096 8192  (the runner's CPU per turn alone)
    python bench/runner_scale.py ... --calculator loop  (the calculator called in the event loop, not its worker)
(progress on stderr, one JSON line on stdout)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import os
import resource
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_rl.core.config import RayConfig
from agent_rl.core.renderers.base import Renderer
from agent_rl.core.renderers.choose import load_renderer
from agent_rl.envs.calculator import CalculatorEnv, arithmetic_tasks
from agent_rl.learn.models import resolve_model
from agent_rl.rollout.engine import Episodes, play_groups
from agent_rl.rollout.players import LocalPlayers
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.rollout.worker import WorkerSettings
from agent_rl.rollout.workers import rollout_workers
from bench.shared.sim_episodes import Workload, workload_shape
from bench.shared.sim_measure import INSTANT, LagMeter, measure_side
from bench.shared.sim_servers import GpuModel

ROOT = Path(__file__).resolve().parents[1]
LOAD_AT_START = os.getloadavg()


async def measure_pair(servers: int, concurrency: int, gpu: GpuModel, work: Workload, renderer: Renderer,
                       warmup: float, window: float, routing: str = "sticky") -> dict[str, Any]:
    """The runner and the ideal client at the same scale, one after the other; the runner's share."""
    runner = await measure_side("runner", servers, concurrency, gpu, work, renderer, warmup, window, routing)
    gc.collect()
    ideal = await measure_side("ideal", servers, concurrency, gpu, work, renderer, warmup, window, routing)
    gc.collect()
    r = lambda x: round(x, 3)  # noqa: E731
    return {"servers": servers, "concurrency": concurrency, "share": r(runner["tok_s"] / ideal["tok_s"]),
            "max_lag_ms": r(runner["max_lag_ms"]), "p99_lag_ms": r(runner["p99_lag_ms"]),
            "runner_tok_s": round(runner["tok_s"]), "ideal_tok_s": round(ideal["tok_s"]),
            "share_of_peak": r(runner["tok_s"] / (servers * gpu.peak_tok_s)), "turns_s": round(runner["turns_s"], 1),
            "cpu_util": r(runner["cpu_util"]), "cpu_ms_per_turn": r(runner["cpu_ms_per_turn"]),
            "ideal_cpu_ms_per_turn": r(ideal["cpu_ms_per_turn"]), "ideal_max_lag_ms": r(ideal["max_lag_ms"]),
            "faults_per_turn": r(runner["faults_per_turn"]), "ideal_faults_per_turn": r(ideal["faults_per_turn"]),
            "server_work_ms_per_turn": r(runner["server_work_ms_per_turn"]),
            "ideal_server_work_ms_per_turn": r(ideal["server_work_ms_per_turn"]),
            # the runner's own: the ideal client pays the simulation's work (its servers, timers, routing) too; the
            # servers' work timed on each side (their JSON, their replies) is left out of both (docs/performance.md)
            "own_cpu_ms_per_turn": r(runner["cpu_ms_per_turn"] - runner["server_work_ms_per_turn"]
                                     - (ideal["cpu_ms_per_turn"] - ideal["server_work_ms_per_turn"])),
            "prefix_hit": r(runner["prefix_hit"]), "ideal_prefix_hit": r(ideal["prefix_hit"]),
            "cpu_wait": r(runner["cpu_wait"]), "window_s": r(runner["window_s"]),
            "gc_in_window_ms": r(runner["gc_in_window_ms"]), "gc_after_ms": r(runner["gc_after_ms"])}


async def measure_ceiling(work: Workload, renderer: Renderer, seconds: float = 8.0) -> dict[str, float]:
    """Both clients against servers that answer at once: the CPU cost of a turn, and the most turns a
    second one runner process (one event loop) can drive on this machine, whatever the GPUs."""
    runner = await measure_side("runner", 8, 512, INSTANT, work, renderer, seconds / 4, seconds, "sticky")
    gc.collect()
    ideal = await measure_side("ideal", 8, 512, INSTANT, work, renderer, seconds / 4, seconds, "sticky")
    gc.collect()
    return {"runner_turns_s": round(runner["turns_s"], 1),
            "runner_cpu_ms_per_turn": round(runner["cpu_ms_per_turn"], 3),
            "ideal_cpu_ms_per_turn": round(ideal["cpu_ms_per_turn"], 3), "cpu_wait": round(runner["cpu_wait"], 3)}


def each_scale(args: argparse.Namespace, measure: Callable[[int, int], Awaitable[dict[str, Any]]]) -> list[dict]:
    """`measure(servers, concurrency)` at every scale asked for, each row printed to stderr as it comes."""
    rows = []
    for servers in args.servers:
        for concurrency in args.concurrency:
            rows.append(asyncio.run(measure(servers, concurrency)))
            gc.collect()
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def runner_only(args: argparse.Namespace, gpu: GpuModel, work: Workload, renderer: Renderer) -> dict[str, Any]:
    """The runner's side alone at each scale (`--runner-only`): its CPU per turn and turns/s, in half the time."""
    async def side(servers: int, concurrency: int) -> dict[str, Any]:
        got = await measure_side("runner", servers, concurrency, gpu, work, renderer, args.warmup, args.window,
                                 args.routing)
        return {"servers": servers, "concurrency": concurrency, **{k: round(v, 3) for k, v in got.items()}}

    return {"bench": "runner_scale", "runner_only": True, "rows": each_scale(args, side)}


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
    import ray  # the `ray` extra: only for --workers

    from bench.shared.sim_remote import SimService, sim_kit

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
    from agent_rl.rollout.ray_connect import connected  # the `ray` extra

    # the cluster's processes import bench/ and agent_rl from here
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[256, 1024, 4096, 8192])
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds before the window")
    ap.add_argument("--window", type=float, default=20.0, help="seconds measured, per side")
    ap.add_argument("--model", default="smollm2-135m", help="whose tokenizer renders the episodes")
    ap.add_argument("--routing", choices=["sticky", "least"], default="sticky")
    ap.add_argument("--calculator", choices=["worker", "loop"], default="worker",
                    help="where the runner's calculator runs: its worker process (as shipped) or in the event loop")
    ap.add_argument("--workers", type=int, nargs="+", help="the runner on this many Ray rollout workers each, against "
                                                          "one shared simulation (bench/shared/sim_remote.py)")
    ap.add_argument("--runner-only", action="store_true",
                    help="only the runner's side at each scale (its CPU per turn, for comparing two trees): no ideal "
                         "client, no ceiling")
    for name, value in asdict(GpuModel()).items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = ap.parse_args()
    gpu = GpuModel(**{k: getattr(args, k) for k in asdict(GpuModel())})
    work = Workload(calculator=args.calculator)
    if args.workers:
        print(json.dumps(workers_bench(args, gpu, work)))
        return
    renderer = load_renderer(resolve_model(args.model))
    if args.runner_only:
        print(json.dumps(runner_only(args, gpu, work, renderer)))
        return
    ceiling = asyncio.run(measure_ceiling(work, renderer))
    print(json.dumps({"ceiling": ceiling}), file=sys.stderr, flush=True)
    rows = each_scale(args, lambda servers, concurrency: measure_pair(
        servers, concurrency, gpu, work, renderer, args.warmup, args.window, args.routing))
    at_target = [row for row in rows if row["concurrency"] == 4096]
    print(json.dumps({
        "bench": "runner_scale", "gpu": asdict(gpu), "peak_tok_s_per_server": round(gpu.peak_tok_s),
        "workload": asdict(work), "routing": args.routing, "ceiling": ceiling, "rows": rows,
        "target": "share >= 0.95 and max_lag_ms < 50 at 4096 episodes",
        "target_met": bool(at_target) and all(x["share"] >= 0.95 and x["max_lag_ms"] < 50 for x in at_target),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }))


if __name__ == "__main__":
    main()
