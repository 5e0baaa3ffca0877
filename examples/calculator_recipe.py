"""The end-to-end recipe: cold-start SFT, then GRPO, then held-out evaluation, on the calculator env
with the built-in SmolLM2-135M-Instruct, sized for a 2-core CPU.

    python examples/calculator_recipe.py                    # one GRPO seed (what `make train` runs)
    python examples/calculator_recipe.py --seeds 0 1 2      # the run-to-run spread docs/recipes.md quotes

Steps (each is an ordinary `agent-rl` command; this script only wires them to one vLLM server):
  1. agent-rl demos   scripted-solver demonstrations, a share of them answering without the tool
  2. agent-rl sft     LoRA adapter on them                      -> RUN/sft/adapter
  3. agent-rl train   GRPO from that adapter, once per seed     -> RUN/grpo-seed{S}/adapter
  4. agent-rl eval    SFT and every GRPO adapter on the same held-out tasks and sampling seeds
Outputs in RUN (default runs/calculator_recipe): eval_before_after.json (the report of step 4) and
eval_before_after.replies.jsonl (every reply of it, with its verdict: `agent-rl view` it),
accuracy_tool_use.png (per GRPO step, a line per seed), summary.json (after - before per seed, spread over
seeds, wall times). It ends with a table (each policy's accuracy, pass@2, pass^2, tool use, attempts, turns;
each seed's gain over SFT and the spread over seeds) and where those files are.

Each command runs in its own process, so the memory of one (a trainer's, several GB) is back
before the next starts. A step whose output already exists is skipped: rerunning a killed recipe goes on
where it stopped (delete RUN to start over).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from agent_rl.cli import raise_on_sigterm
from agent_rl.learn.models import resolve_model
from agent_rl.rollout.serving.vllm.server import VLLMServer
from agent_rl.runs.plot import plot_runs
from agent_rl.runs.replies import replies_path
from agent_rl.runs.summary import policy_table, where

CONFIG = str(Path(__file__).with_name("calculator_recipe.yaml"))
FIGURES = ("accuracy", "tool_use_rate", "accuracy_with_tools", "accuracy_without_tools", "pass@2")


def run(done: Path, *argv: str) -> float | None:
    """One agent-rl command in its own process, unless `done` exists; stops the recipe on failure.
    Returns its wall time in seconds (None: skipped)."""
    if done.exists():
        print(f"\n(skipped: {done} exists) agent-rl {argv[0]}", file=sys.stderr, flush=True)
        return None
    t0 = time.perf_counter()
    print("\n$ agent-rl " + " ".join(argv), file=sys.stderr, flush=True)
    code = subprocess.run([sys.executable, "-m", "agent_rl.cli", *argv]).returncode
    if code:
        sys.exit(f"recipe stopped: `agent-rl {' '.join(argv)}` exited with {code}")
    return time.perf_counter() - t0


def summarise(report: dict, before: str, after: dict[int, str], wall: dict[str, float]) -> dict:
    res = report["results"]
    out: dict = {"before": {k: res[before][k] for k in FIGURES}, "after": {}, "gain": {}, "wall_s": wall}
    for seed, label in after.items():
        out["after"][seed] = {k: res[label][k] for k in FIGURES}
        out["gain"][seed] = {k: res[label][k] - res[before][k] for k in FIGURES}
    for k in ("accuracy", "tool_use_rate"):
        gains = [g[k] for g in out["gain"].values()]
        afters = [a[k] for a in out["after"].values()]
        out[f"{k}_min_gain"] = min(gains)
        out[f"{k}_seed_spread"] = max(afters) - min(afters)  # max - min of the after figure over seeds
    return out


def ending(report: dict, out: Path, after: dict[int, str], total_s: float) -> str:
    """The lines the recipe ends with: the table of its policies (each seed's gain over SFT, the spread over
    seeds) and where its files are."""
    names = {str(out / "sft"): "sft", **{label: f"grpo seed {seed}" for seed, label in after.items()}}
    table = policy_table(report["results"], baseline=str(out / "sft"), names=names, spread="seed spread")
    replies = replies_path(out / "eval_before_after.json")
    return table + "\n" + where(curves=out / "accuracy_tool_use.png", report=out / "eval_before_after.json",
                                replies=f"{replies} (agent-rl view {replies})",
                                summary=f"{out / 'summary.json'} (gains, wall times: {total_s:.0f} s in all)")


def main() -> None:
    raise_on_sigterm()  # a SIGTERM unwinds the recipe like Ctrl-C: its server stops
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", default="runs/calculator_recipe")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="one GRPO run per seed, all from one SFT")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every step")
    args = p.parse_args()
    out = Path(args.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    wall: dict[str, float | None] = {}
    t_start = time.perf_counter()
    model_dir = resolve_model("smollm2-135m")
    # one server for every step: LoRA adapters are hot-loaded under unique names, so the SFT
    # adapter, each GRPO run's versions and the evaluated adapters never collide
    # dev mode: GRPO pushes merged weights where that pays (model.sync auto) and restores the base ones after
    with VLLMServer(model_dir, max_lora_rank=16, max_loras=4, kv_cache_gib=2, max_model_len=1024,
                    log_path=out / "vllm.log", dev_mode=True) as server:
        common = ["--set", f"sampler.server_urls=[{server.url}]", *[x for s in args.set for x in ("--set", s)]]
        wall["server_start"] = time.perf_counter() - t_start
        wall["demos"] = run(out / "demos.jsonl", "demos", CONFIG, *common, "--set", f"sft.demos={out}/demos.jsonl")
        wall["sft"] = run(out / "sft" / "adapter", "sft", CONFIG, *common, "--set", f"sft.demos={out}/demos.jsonl",
                          "--set", f"sft.run_dir={out}/sft")
        after = {}
        for seed in args.seeds:
            run_dir = out / f"grpo-seed{seed}"
            wall[f"grpo_seed{seed}"] = run(run_dir / "adapter", "train", CONFIG, *common,
                                           "--set", f"model.init_adapter={out}/sft/adapter",
                                           "--set", f"run.run_dir={run_dir}", "--set", f"run.seed={seed}")
            after[seed] = str(run_dir)
        adapters = [x for a in [str(out / "sft"), *after.values()] for x in ("--adapter", a)]
        (out / "eval_before_after.json").unlink(missing_ok=True)  # always evaluate what is there now
        wall["eval"] = run(out / "eval_before_after.json", "eval", CONFIG, *common, *adapters,
                           "--out", str(out / "eval_before_after.json"))
    plot_runs([out / f"grpo-seed{seed}" for seed in args.seeds], out / "accuracy_tool_use.png")
    wall["total"] = time.perf_counter() - t_start
    report = json.loads((out / "eval_before_after.json").read_text())
    summary = summarise(report, str(out / "sft"), after, wall)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("\n" + ending(report, out, after, wall["total"]))


if __name__ == "__main__":
    main()
