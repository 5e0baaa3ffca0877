"""What rollout traces cost a training step: time to write one step's traces, bytes on disk, page size.

Owns: timing only; prints progress to stderr and ends with one JSON line on stdout. Episodes are real calculator
episodes played by the environment's scripted solver through the rollout runner with the SmolLM2 renderer (no model:
the tokens are what a tool-using policy would produce); `write_over_rollout` sets the write time against the time
those scripted rollouts took, which is far below a sampled step's, so the share in a real step is smaller still.
Usage: python bench/traces.py [--groups 8] [--group-size 4] [--trace-groups 2] [--reps 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time

from agent_rl.core.registry import load_env
from agent_rl.core.renderers.choose import load_renderer
from agent_rl.learn.advantages import group_advantages
from agent_rl.learn.models import resolve_model
from agent_rl.rollout.engine import rollout_groups
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.rollout.scripted import ScriptedSampler
from agent_rl.runs import traces, view


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--trace-groups", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    renderer = load_renderer(resolve_model("smollm2-135m"))
    spec = load_env("calculator")
    tasks = spec.load_tasks(args.groups, seed=0, split="train")

    async def play():  # each task with its own solver-driven sampler, as `agent-rl demos` plays them
        return [g for t in tasks for g in await rollout_groups(
            [t], spec.make_env, ScriptedSampler(renderer, lambda m, t=t: spec.solve(t, m), on_messages=True),
            renderer, EpisodeLimits(), args.group_size)]

    t0 = time.perf_counter()
    groups = asyncio.run(play())
    rollout_s = time.perf_counter() - t0
    adv = group_advantages(groups)
    picked = traces.pick_groups(groups, args.trace_groups)
    tokens = sum(len(t.token_ids) for g in picked for t in groups[g].trajectories)
    with tempfile.TemporaryDirectory() as run_dir:
        times = []
        for step in range(1, args.reps + 1):
            t0 = time.perf_counter()
            path = traces.write_step(run_dir, step, groups, adv, renderer, args.trace_groups)
            times.append(time.perf_counter() - t0)
        size = path.stat().st_size
        t0 = time.perf_counter()
        page = view.write_page(run_dir)
        view_s = time.perf_counter() - t0
        page_size = page.stat().st_size
    write_s = statistics.median(times)
    print(f"{len(picked)} groups, {tokens} tokens: {write_s * 1000:.1f} ms, {size} bytes", file=sys.stderr)
    print(json.dumps({
        "groups": args.groups, "group_size": args.group_size, "trajectories_traced": len(picked) * args.group_size,
        "tokens_traced": tokens, "write_ms_p50": round(write_s * 1000, 2), "bytes_per_token": round(size / tokens, 1),
        "step_file_kib": round(size / 1024, 1), "page_kib_per_step": round(page_size / args.reps / 1024, 1),
        "view_ms_per_step": round(view_s / args.reps * 1000, 2), "write_over_rollout": round(write_s / rollout_s, 3),
    }))


if __name__ == "__main__":
    main()
