"""Where a turn's CPU goes in place: the runner's side of bench/runner_scale.py, with the parts of a turn timed.

Owns: timing only. The runner plays calculator episodes against the simulated servers exactly as
`bench/runner_scale.py --runner-only` does (`sim_measure.measure_side`), while each part below is wrapped in a timer
of the thread's CPU time: a part costs several times more in place than in a tight loop, so only a measurement in
place says what to cut (docs/performance.md#where-a-turns-cpu-goes). Each part's figure includes its timer's own
cost; `cpu_ms_per_turn` is the process's over the window, with them. The parts are counted over the whole run,
warm-up included, per response read (one a turn).

Parts: reading the response (`read_response`), its checks (`response_completion`), decoding and parsing the turn
(`Renderer.parse`), the token buffer (`add_sampled` + `add_context`, and `segment`, which writes the mask, log-probs
and versions out when a segment or the episode ends), the request's JSON (the prompt ids' dump and `request_body`), the
tool's argument check (`Tool.validate`), the write of a tool call to its worker's pipe (`write_all`), the context
after a tool's result (`next_context`), and the simulated servers' choice of each reply (`reply_plan`). Ends with one
JSON line: {"servers", "concurrency", "turns", "cpu_ms_per_turn",
"parts_us_per_turn": {part: us}, "calls_per_turn": {part: calls}}.

    python bench/turn_parts.py [--servers 64] [--concurrency 4096] [--warmup 8] [--window 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench.shared.sim_episodes as episodes
from agent_rl.core.renderers.base import Renderer
from agent_rl.core.renderers.choose import load_renderer
from agent_rl.learn.models import resolve_model
from agent_rl.rollout import runner
from agent_rl.rollout.serving.vllm import sampler
from agent_rl.tools import base, worker_pool
from bench.shared.sim_episodes import Workload
from bench.shared.sim_measure import INSTANT, measure_side
from bench.shared.sim_servers import GpuModel


class Parts:
    """Thread CPU seconds and calls of each part."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] = self.seconds.get(part, 0.0) + time.thread_time() - t
                self.calls[part] = self.calls.get(part, 0) + 1
        return wrapped


def instrument(parts: Parts) -> None:
    """Wrap each part where the runner's side calls it (the names the calling modules hold)."""
    dumps = episodes.orjson.dumps

    class Orjson:  # the simulated sampler's orjson, its `dumps` (the prompt ids' JSON) timed
        def __getattr__(self, name: str) -> Any:
            return getattr(sampler.orjson, name)

    Orjson.dumps = staticmethod(parts.timed("request JSON", dumps))  # type: ignore[attr-defined]
    episodes.orjson = Orjson()  # type: ignore[assignment]
    episodes.request_body = parts.timed("request JSON", sampler.request_body)
    episodes.read_response = parts.timed("reading the response", sampler.read_response)
    episodes.response_completion = parts.timed("_completion", sampler.response_completion)
    episodes.SimSampler.reply_plan = parts.timed("servers: reply choice", episodes.SimSampler.reply_plan)
    Renderer.parse = parts.timed("decoding and parsing", Renderer.parse)  # type: ignore[method-assign]
    Renderer.next_context = parts.timed("next context", Renderer.next_context)  # type: ignore[method-assign]
    runner.TokenBuffer.add_sampled = parts.timed("token buffer", runner.TokenBuffer.add_sampled)  # type: ignore[method-assign]
    runner.TokenBuffer.add_context = parts.timed("token buffer", runner.TokenBuffer.add_context)  # type: ignore[method-assign]
    runner.TokenBuffer.segment = parts.timed("token buffer", runner.TokenBuffer.segment)  # type: ignore[method-assign]
    base.Tool.validate = parts.timed("tool argument check", base.Tool.validate)  # type: ignore[method-assign]
    worker_pool.write_all = parts.timed("tool call pipe write", worker_pool.write_all)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4096)
    ap.add_argument("--warmup", type=float, default=8.0)
    ap.add_argument("--window", type=float, default=10.0)
    args = ap.parse_args()
    renderer = load_renderer(resolve_model("smollm2-135m"))
    parts = Parts()
    instrument(parts)
    gpu = INSTANT if args.servers == 8 else GpuModel()
    got = asyncio.run(measure_side("runner", args.servers, args.concurrency, gpu, Workload(), renderer,
                                   args.warmup, args.window, "sticky"))
    turns = parts.calls["reading the response"]  # one response a turn, warm-up included (as every part's count)
    print(json.dumps({
        "servers": args.servers, "concurrency": args.concurrency, "turns": turns,
        "cpu_ms_per_turn": round(got["cpu_ms_per_turn"], 3),
        "parts_us_per_turn": {k: round(1e6 * v / turns, 1) for k, v in
                              sorted(parts.seconds.items(), key=lambda kv: -kv[1])},
        "calls_per_turn": {k: round(v / turns, 2) for k, v in parts.calls.items()},
    }))


if __name__ == "__main__":
    main()
