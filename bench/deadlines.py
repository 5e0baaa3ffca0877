"""What a deadline costs an await when thousands are in flight: `asyncio.timeout` against `core.deadline`.

Owns: timing only. `tasks` tasks each loop over `async with <deadline>(120 s): await asyncio.sleep(0)` (one pass
of the event loop inside the deadline, as a runner's env step or tool call has at least one), while `live`
other timers wait in the loop's heap: what a rollout's HTTP client holds (aiohttp keeps a timer per request in
flight: 4,096 episodes waiting for their servers are 4,096 timers). The three sides (no deadline, asyncio's,
core's) alternate round by round, so machine noise falls on all of them alike; each figure is the median over the
rounds of the event loop's CPU per await, and `*_own_us` subtracts the bare await's. Ends with one JSON line.

    python bench/deadlines.py [--tasks 4096] [--live 0 4096 16384] [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_rl.core.deadline import deadline


class _NoDeadline:
    """The bare await's side: an async context manager that does nothing."""

    def __init__(self, timeout_s: float):
        pass

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


SIDES: dict[str, Callable[[float], Any]] = {"bare": _NoDeadline, "asyncio": asyncio.timeout, "deadline": deadline}


async def one_round(side: str, tasks: int, passes: int) -> float:
    """CPU seconds per await of `tasks` tasks making `passes` awaits each under `side`'s deadline."""
    make = SIDES[side]

    async def task() -> None:
        for _ in range(passes):
            async with make(120.0):
                await asyncio.sleep(0)

    cpu = time.process_time()
    await asyncio.gather(*(task() for _ in range(tasks)))
    return (time.process_time() - cpu) / (tasks * passes)


async def measure(tasks: int, live: int, rounds: int, passes: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    timers = [loop.call_later(3600 + i * 1e-3, lambda: None) for i in range(live)]  # long waits: never fire here
    try:
        await one_round("deadline", tasks, passes)  # warm both paths
        await one_round("asyncio", tasks, passes)
        got: dict[str, list[float]] = {side: [] for side in SIDES}
        for _ in range(rounds):
            for side in SIDES:
                got[side].append(await one_round(side, tasks, passes))
    finally:
        for t in timers:
            t.cancel()
    us = {side: 1e6 * statistics.median(v) for side, v in got.items()}
    own = {side: us[side] - us["bare"] for side in ("asyncio", "deadline")}
    return {"live": live, "bare_us": round(us["bare"], 3), "asyncio_us": round(us["asyncio"], 3),
            "deadline_us": round(us["deadline"], 3), "asyncio_own_us": round(own["asyncio"], 3),
            "deadline_own_us": round(own["deadline"], 3),
            "own_ratio": round(own["deadline"] / own["asyncio"], 3) if own["asyncio"] > 0 else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=4096)
    ap.add_argument("--live", type=int, nargs="+", default=[0, 4096, 16384])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--passes", type=int, default=20, help="awaits per task per round")
    args = ap.parse_args()
    rows = []
    for live in args.live:
        rows.append(asyncio.run(measure(args.tasks, live, args.rounds, args.passes)))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"bench": "deadlines", "tasks": args.tasks, "rounds": args.rounds, "passes": args.passes,
                      "rows": rows}))


if __name__ == "__main__":
    main()
