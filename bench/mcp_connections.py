"""What an MCP connection costs: per-episode stdio servers against one shared connection.

Owns: timing only; prints progress to stderr and ends with one JSON line on stdout. The server is
examples/mcp_units_server.py (the SDK's MCPServer). "per episode" opens N stdio connections at once (N server
processes, as `MCPEnv(shared=False)` would for N concurrent episodes); "shared" is what N episodes of `MCPEnv()`
wait for: one start.
Usage: python bench/mcp_connections.py [--episodes 16] [--calls 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from agent_rl.tools.mcp import connect, mcp_server

SERVER = Path(__file__).resolve().parents[1] / "examples" / "mcp_units_server.py"


def percentiles(seconds: list[float], scale: float = 1000.0) -> dict[str, float]:
    ordered = sorted(seconds)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": round(pick(0.5) * scale, 3), "p90": round(pick(0.9) * scale, 3)}


async def timed_connect(spec) -> tuple[float, object]:
    start = time.perf_counter()
    conn = await connect(spec)
    return time.perf_counter() - start, conn


async def call_latency(conn, calls: int, concurrent: int) -> tuple[list[float], float]:
    convert = next(t for t in conn.tools if t.name == "convert")
    args = {"value": 3.5, "from_unit": "mi", "to_unit": "km"}
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        result = await convert.call(args)
        seconds.append(time.perf_counter() - start)
        assert result.ok, result
    start = time.perf_counter()
    results = await asyncio.gather(*(convert.call(args) for _ in range(concurrent)))
    assert all(r.ok for r in results)
    return seconds, time.perf_counter() - start


def http_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(SERVER), "--http", str(port)], stderr=subprocess.DEVNULL)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"http://127.0.0.1:{port}/mcp"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("error: the units server did not listen within 60 s")


async def main(episodes: int, calls: int) -> dict:
    stdio = mcp_server([sys.executable, str(SERVER)], name="units", start_timeout_s=300)
    print(f"starting {episodes} stdio servers at once...", file=sys.stderr)
    start = time.perf_counter()
    opened = await asyncio.gather(*(timed_connect(stdio) for _ in range(episodes)))
    per_episode_wall = time.perf_counter() - start
    await asyncio.gather(*(conn.aclose() for _, conn in opened))
    print("starting one shared server...", file=sys.stderr)
    shared_wall, conn = await timed_connect(stdio)
    stdio_calls, stdio_burst = await call_latency(conn, calls, concurrent=4 * episodes)
    await conn.aclose()
    proc, url = http_server()
    try:
        _, http_conn = await timed_connect(mcp_server(url, name="units-http"))
        http_calls, http_burst = await call_latency(http_conn, calls, concurrent=4 * episodes)
        await http_conn.aclose()
    finally:
        proc.terminate()
        proc.wait(10)
    starts = sorted(s for s, _ in opened)
    return {"episodes": episodes,
            "stdio_start_s": {"p50": round(starts[len(starts) // 2], 3), "max": round(starts[-1], 3)},
            "per_episode_starts_wall_s": round(per_episode_wall, 3), "shared_start_wall_s": round(shared_wall, 3),
            "per_episode_over_shared": round(per_episode_wall / shared_wall, 2),
            "call_ms": {"stdio": percentiles(stdio_calls), "http": percentiles(http_calls)},
            "concurrent_calls": 4 * episodes,
            "concurrent_calls_wall_s": {"stdio": round(stdio_burst, 3), "http": round(http_burst, 3)}}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.episodes, args.calls))))
