"""Speed-up of rollouts streaming on while the trainer trains (`algorithm.max_staleness` k, default 1)
against the synchronous loop (k = 0), on this machine: one vLLM server beside the trainer.

Runs `agent_rl.trainer.train` twice per repetition on one vLLM server, alternating
`algorithm.max_staleness=0` and `=k` with the same seed and config, and reports the
ratio of median wall time per step (steps after the first, which warms up). Default: the tiny
test model on the toy environment, where rollouts and training take comparable time; pass
`--model smollm2-135m --env calculator` for the real model. What the stream gives on many GPU
servers with long-tailed episodes is bench/async_sim.py's to say.

    python bench/overlap.py [--staleness K] [--model M] [--env E] [--steps N] [--reps R] [--server-url URL]

Prints one JSON line: sync_step_s, overlap_step_s, overlap_speedup (sync / overlap).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_rl.config.file import load_config
from agent_rl.learn.models import build_tiny_model, cache_dir, resolve_model
from agent_rl.rollout.serving.vllm.server import VLLMServer, attach
from agent_rl.trainer import train


def step_times(url: str, model_dir: Path, args, overlap: bool, run_dir: Path) -> list[float]:
    cfg = load_config(None, [
        f"model.name={model_dir}", "model.lora_rank=8", f"sampler.server_urls=[{url}]",
        "sampler.max_model_len=2048", f"rollout.env={args.env}", f"rollout.tasks_per_step={args.tasks}",
        f"rollout.group_size={args.group_size}", "rollout.max_turns=2", "rollout.max_tokens_per_turn=64",
        "rollout.max_total_tokens=1024", f"algorithm.max_staleness={args.staleness if overlap else 0}",
        f"run.steps={args.steps}", f"run.run_dir={run_dir}", "run.save_every=1000", "run.tensorboard=false",
    ])
    asyncio.run(train(cfg))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["time/step_s"] for r in rows[1:]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--staleness", type=int, default=1, help="the streaming side's algorithm.max_staleness")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--env", default="toy")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--server-url")
    args = ap.parse_args()
    if args.model == "tiny":
        model_dir = build_tiny_model("smollm2-135m", cache_dir() / "models" / "tiny-smollm2")
    else:
        model_dir = resolve_model(args.model)
    server = None if args.server_url else VLLMServer(model_dir, kv_cache_gib=2, max_model_len=2048).start()
    url = attach(args.server_url) if args.server_url else server.url
    sync_s: list[float] = []
    overlap_s: list[float] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(args.reps):
                sync_s += step_times(url, model_dir, args, False, Path(tmp) / f"sync{rep}")
                overlap_s += step_times(url, model_dir, args, True, Path(tmp) / f"overlap{rep}")
    finally:
        if server:
            server.stop()
    a, b = statistics.median(sync_s), statistics.median(overlap_s)
    print(json.dumps({"bench": "overlap", "staleness": args.staleness, "model": args.model, "env": args.env,
                      "steps": args.steps, "reps": args.reps, "sync_step_s": round(a, 3), "overlap_step_s": round(b, 3),
                      "overlap_speedup": round(a / b, 3)}))


if __name__ == "__main__":
    main()
