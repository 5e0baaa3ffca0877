"""Per-call cost of where a synchronous tool runs: the calculator in a thread, in a worker process,
and through `asyncio.to_thread` (how every sync tool ran before deadlines were made real).

Owns: timing only; prints progress to stderr and ends with one JSON line on stdout (latencies in ms, p50 / p90).
The three runners alternate call by call, so machine noise falls on all of them alike.
`loop_cpu_us`: the median CPU time of the calling thread (the event loop's) per call, which is what a call
costs the rollout runner; the tool's own work in a worker or a thread is not in it. `pipe_write_cpu_us`: the
writer's CPU for one 200-byte write into a pipe whose reader process sleeps in read (the write wakes it, as a
worker call's request does) and into a pipe nobody reads. `concurrent_loop_cpu_us`: the loop's CPU per call when
64 rollouts call at once, on a pool whose workers take one call at a time (how the pool worked before pipelining,
`WorkerPool(depth=1)`) and on one that writes calls behind a busy worker's (`tools.worker_pool.DEPTH`), alternated.
Usage: python bench/tool_call.py [--calls 500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

from agent_rl.tools import worker_pool
from agent_rl.tools.base import Tool
from agent_rl.tools.calculator import calculator
from agent_rl.tools.runners import function_address

EXPRESSION = {"expression": "(123 + 456) * 789 / 3"}


def percentiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": round(pick(0.5) * 1000, 4), "p90": round(pick(0.9) * 1000, 4)}


async def timed(coro, cpu: list[float]) -> float:
    start, start_cpu = time.perf_counter(), time.thread_time()
    result = await coro
    cpu.append(time.thread_time() - start_cpu)
    assert result.ok, result
    return time.perf_counter() - start


def pipe_write_cpu_us(writes: int = 5000) -> dict[str, float]:
    """The writer's CPU per write: into a pipe whose reader process sleeps in read, and into one nobody reads."""
    read_end, write_end = os.pipe()
    reader = subprocess.Popen([sys.executable, "-c", f"import os\nwhile os.read({read_end}, 65536): pass"],
                              pass_fds=(read_end,))
    os.close(read_end)
    message, woken = b"x" * 200, []
    try:
        time.sleep(0.3)  # the reader is up and blocked in read
        for _ in range(writes):
            time.sleep(0.0002)  # the reader has read the last one and sleeps again
            t0 = time.thread_time()
            os.write(write_end, message)
            woken.append(time.thread_time() - t0)
    finally:
        os.close(write_end)
        reader.wait(timeout=30)
    read_end, write_end = os.pipe()
    quiet = []
    try:
        for _ in range(200):  # 40 kB: within the pipe's buffer, so no write waits
            t0 = time.thread_time()
            os.write(write_end, message)
            quiet.append(time.thread_time() - t0)
    finally:
        os.close(read_end)
        os.close(write_end)
    return {"wakes_reader": round(statistics.median(woken) * 1e6, 2),
            "no_reader": round(statistics.median(quiet) * 1e6, 2)}


async def to_thread_call(tool: Tool):
    """The old path: validate, then `asyncio.to_thread` under `wait_for` (no stop at the deadline)."""
    from agent_rl.tools.base import ToolResult

    out = await asyncio.wait_for(asyncio.to_thread(tool.fn, **tool.validate(EXPRESSION)), tool.timeout_s)
    return ToolResult(ok=True, content=out)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


async def main(calls: int) -> dict:
    thread, worker = Tool(calculator, isolate=False), Tool(calculator)
    start = time.perf_counter()
    await worker.call(EXPRESSION)  # starts the first worker process and imports tools.calculator there
    worker_start = time.perf_counter() - start
    pool = worker_pool._POOLS[asyncio.get_running_loop()]
    times: dict[str, list[float]] = {"direct": [], "to_thread": [], "thread": [], "worker": []}
    cpu: dict[str, list[float]] = {k: [] for k in times}
    for i in range(calls):
        t0, c0 = time.perf_counter(), time.thread_time()
        calculator(**EXPRESSION)
        times["direct"].append(time.perf_counter() - t0)
        cpu["direct"].append(time.thread_time() - c0)
        times["to_thread"].append(await timed(to_thread_call(thread), cpu["to_thread"]))
        times["thread"].append(await timed(thread.call(EXPRESSION), cpu["thread"]))
        times["worker"].append(await timed(worker.call(EXPRESSION), cpu["worker"]))
        if i % 100 == 0:
            print(f"{i}/{calls}", file=sys.stderr)
    await asyncio.gather(*(worker.call(EXPRESSION) for _ in range(32)))  # starts the pool's other workers
    start = time.perf_counter()  # 32 rollouts calling at once share the pool's slots
    await asyncio.gather(*(worker.call(EXPRESSION) for _ in range(32)))
    concurrent = (time.perf_counter() - start) / 32
    stats = {k: percentiles(v) for k, v in times.items()}
    return {"calls": calls, **{f"{k}_ms": v for k, v in stats.items()},
            "loop_cpu_us": {k: round(statistics.median(v) * 1e6, 2) for k, v in cpu.items()},
            "pipe_write_cpu_us": pipe_write_cpu_us(),
            "worker_over_thread_p50": round(stats["worker"]["p50"] / stats["thread"]["p50"], 2),
            "thread_over_to_thread_p50": round(stats["thread"]["p50"] / stats["to_thread"]["p50"], 2),
            "worker_start_s": round(worker_start, 3), "pool_size": worker_pool.POOL_SIZE,
            "worker_rss_mib": round(max(rss_mib(w.proc.pid) for w in pool.workers), 1),
            "concurrent_worker_ms_per_call": round(concurrent * 1000, 4), "workers": len(pool.workers),
            **await pipelining()}


async def pipelining(width: int = 64, rounds: int = 7, batches: int = 20) -> dict:
    """The loop's CPU per call with `width` calls at once, one call per worker at a time against pipelined, side
    by side: each round measures both, in turn, over `batches` batches; the medians of the rounds."""
    address = function_address(calculator)
    pools = {"one_at_a_time": worker_pool.WorkerPool(depth=1), "pipelined": worker_pool.WorkerPool()}
    cpu: dict[str, list[float]] = {k: [] for k in pools}
    for _ in range(rounds):
        for name, pool in pools.items():
            await asyncio.gather(*(pool.call(address, EXPRESSION, 5.0) for _ in range(width)))  # every worker up
            start = time.thread_time()
            for _ in range(batches):
                replies = await asyncio.gather(*(pool.call(address, EXPRESSION, 5.0) for _ in range(width)))
                assert all(r == ("ok", "152277") for r in replies), replies[0]
            cpu[name].append((time.thread_time() - start) / (batches * width))
    us = {k: round(statistics.median(v) * 1e6, 2) for k, v in cpu.items()}
    return {"concurrent_loop_cpu_us": us,
            "pipelined_over_one_at_a_time": round(us["pipelined"] / us["one_at_a_time"], 2)}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=500)
    print(json.dumps(asyncio.run(main(p.parse_args().calls))))
