"""Two ways to stop a CPU trainer's memory from growing step after step, and what each costs.

Runs the same SFT-style training steps (the recipe's calculator demonstrations, SmolLM2-135M with a
rank-16 LoRA, `nll_step` + AdamW, micro-batches of at most --micro-batch-tokens) in fresh child
processes, alternately with glibc's default heap, with a fixed 1 MB mmap threshold ("mmap"), and
with the default heap plus `allocator.release_freed_memory()` (malloc_trim) after every step ("trim"),
and with the trim plus `allocator.cap_heap_buffers()` (a fixed 4 MiB mmap threshold: "cap", what the
trainer does now), --reps times each, and reports per mode the median step time, the process's RSS
after the last step and its peak RSS (within steps too). Only "cap" keeps the cap that
`build_policy` sets.
Same demos, same batches, same seed in every child: only the allocator handling differs. Ratios (step times
leave the first step out): "mmap" and "trim" against the default (`step_time_ratio`, `rss_ratio`,
`trim_*`), "cap" against "trim" (`cap_step_time_ratio`, `cap_peak_rss_ratio`: the peak within a step is what the
cap is for).

    python bench/allocator.py [--steps 6] [--batch 4] [--reps 2] [--micro-batch-tokens 2048]

Prints progress to stderr and one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def child(demos_path: str, mode: str, steps: int, batch: int, micro_batch_tokens: int) -> None:
    """One measured run; prints {"step_s": [...], "rss_mib": [...]} on stdout."""
    if mode == "mmap":  # what MALLOC_MMAP_THRESHOLD_=1048576 sets at start-up (M_MMAP_THRESHOLD is -3)
        import ctypes

        assert ctypes.CDLL(None).mallopt(-3, 1 << 20) == 1, "no glibc mallopt here"
    import resource

    import torch

    from agent_rl.learn import policy as policy_module

    if mode != "cap":  # build_policy caps heap buffers; every other mode measures the heap without it
        policy_module.cap_heap_buffers = lambda: False
    from agent_rl.config.file import load_config
    from agent_rl.core.renderers.choose import load_renderer
    from agent_rl.demos import read_demos
    from agent_rl.learn.allocator import release_freed_memory
    from agent_rl.learn.models import resolve_model
    from agent_rl.learn.policy import build_policy
    from agent_rl.sft import nll_step

    torch.manual_seed(0)
    cfg = load_config(None, ["model.name=smollm2-135m"])
    model_dir = resolve_model(cfg.model.name)
    pad_id = load_renderer(model_dir).pad_token_id
    policy = build_policy(cfg.model, cfg.optim, model_dir)
    model, optimizer = policy.model, policy.optimizer
    demos = read_demos(demos_path)
    model.train()
    step_s, rss = [], []
    for step in range(steps):
        rows = [demos[(step * batch + i) % len(demos)] for i in range(batch)]
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        nll_step(model, rows, pad_id, micro_batch_tokens, cfg.optim.logprob_chunk, train=True)
        optimizer.step()
        if mode in ("trim", "cap"):
            release_freed_memory()  # what agent_rl.learn.update.optimizer_step does after every step
        step_s.append(time.perf_counter() - t0)
        rss.append(rss_mib())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"step_s": step_s, "rss_mib": rss, "peak_mib": peak}))


def make_demos_file(path: Path) -> None:
    from agent_rl.core.registry import load_env
    from agent_rl.core.renderers.choose import load_renderer
    from agent_rl.demos import make_demos, write_demos
    from agent_rl.learn.models import resolve_model
    from agent_rl.rollout.runner import EpisodeLimits

    renderer = load_renderer(resolve_model("smollm2-135m"))
    limits = EpisodeLimits(max_turns=3, max_tokens_per_turn=64, max_total_tokens=768)  # the recipe's
    demos, _ = asyncio.run(make_demos(load_env("calculator"), renderer, 64, direct_share=0.3, limits=limits))
    write_demos(path, demos)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=4, help="demonstrations per step")
    p.add_argument("--reps", type=int, default=2, help="children per mode, alternating")
    p.add_argument("--micro-batch-tokens", type=int, default=2048)
    p.add_argument("--child", nargs=2, metavar=("DEMOS", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(*args.child, args.steps, args.batch, args.micro_batch_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        demos = Path(tmp) / "demos.jsonl"
        make_demos_file(demos)
        runs: dict[str, list[dict]] = {"default": [], "mmap": [], "trim": [], "cap": []}
        for rep in range(args.reps):
            for mode in (list(runs) if rep % 2 == 0 else list(runs)[::-1]):
                argv = [sys.executable, __file__, "--child", str(demos), mode, "--steps", str(args.steps),
                        "--batch", str(args.batch), "--micro-batch-tokens", str(args.micro_batch_tokens)]
                out = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=True)
                runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
                r = runs[mode][-1]
                print(f"{mode}: median step {statistics.median(r['step_s']):.2f} s, "
                      f"RSS after last step {r['rss_mib'][-1]:.0f} MiB", file=sys.stderr, flush=True)
    figures = {}
    for mode, rs in runs.items():
        figures[mode] = {"step_s_median": round(statistics.median(s for r in rs for s in r["step_s"][1:]), 3),
                         "rss_last_mib": round(statistics.median(r["rss_mib"][-1] for r in rs)),
                         "rss_peak_mib": round(max(r["peak_mib"] for r in rs))}
    figures["step_time_ratio"] = round(figures["mmap"]["step_s_median"] / figures["default"]["step_s_median"], 3)
    figures["rss_ratio"] = round(figures["mmap"]["rss_last_mib"] / figures["default"]["rss_last_mib"], 3)
    figures["trim_step_time_ratio"] = round(figures["trim"]["step_s_median"] / figures["default"]["step_s_median"], 3)
    figures["trim_rss_ratio"] = round(figures["trim"]["rss_last_mib"] / figures["default"]["rss_last_mib"], 3)
    figures["cap_step_time_ratio"] = round(figures["cap"]["step_s_median"] / figures["trim"]["step_s_median"], 3)
    figures["cap_peak_rss_ratio"] = round(figures["cap"]["rss_peak_mib"] / figures["trim"]["rss_peak_mib"], 3)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
