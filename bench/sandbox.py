"""Per-call latency of the Python sandbox: one-shot runs and warm-session calls, per available backend.

Owns: timing only; prints progress to stderr and ends with one JSON line on stdout (per backend). Targets:
bubblewrap one-shot p50 <= 20 ms, warm session p50 <= 1 ms.
Usage: python bench/sandbox.py [--calls 50] [--backends bubblewrap,docker,subprocess]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time

from agent_rl.tools.sandbox import Limits, get_backend
from agent_rl.tools.sandbox_bwrap import unavailable_reason as bwrap_missing
from agent_rl.tools.sandbox_docker import unavailable_reason as docker_missing


def percentiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": round(pick(0.5) * 1000, 3), "p90": round(pick(0.9) * 1000, 3)}


async def bench(name: str, calls: int) -> dict[str, dict[str, float]]:
    backend = get_backend(name, Limits())
    await backend.run("pass")  # warm the page cache and the uid pool
    oneshot = []
    for i in range(calls):
        start = time.perf_counter()
        result = await backend.run(f"print({i})")
        oneshot.append(time.perf_counter() - start)
        assert result.stdout == f"{i}\n", result
    starts = []
    for _ in range(max(3, calls // 5)):
        start = time.perf_counter()
        async with backend.session() as s:
            await s.run("pass")
            starts.append(time.perf_counter() - start)
    session = []
    async with backend.session() as s:
        await s.run("n = 0")
        for i in range(calls):
            start = time.perf_counter()
            result = await s.run("n += 1\nprint(n)")
            session.append(time.perf_counter() - start)
            assert result.stdout == f"{i + 1}\n", result
    return {
        "oneshot_ms": percentiles(oneshot),
        "session_start_ms": percentiles(starts),  # start + first call
        "session_ms": percentiles(session),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--backends", default="bubblewrap,docker,subprocess")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the subprocess backend's isolation warning is expected here
    missing = {"bubblewrap": bwrap_missing, "docker": docker_missing, "subprocess": lambda: None}
    report: dict[str, object] = {"calls": args.calls}
    for name in args.backends.split(","):
        if name not in missing:
            sys.exit(f"error: unknown backend {name!r}; choose from {', '.join(missing)}")
        if reason := missing[name]():
            report[name] = {"skipped": reason}
        else:
            report[name] = asyncio.run(bench(name, args.calls))
        print(f"{name}: {report[name]}", file=sys.stderr)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
