"""Bare JSON tool calls, measured: does GRPO train Qwen2.5-Coder-0.5B-Instruct on the calculator when its
tag-less calls (`{"name": "calculator", "arguments": {...}}`) are read as calls, or only when they carry
`<tool_call>` tags?

    python examples/bare_calls_study.py              # both arms, seed 0
    python examples/bare_calls_study.py --set run.steps=1 --run-dir runs/bare_try

Arms (`model.bare_tool_calls`; everything else equal, from the base model, no cold start):
  strict    only tagged calls are calls: a bare call is the final reply, which states no answer (reward 0)
  lenient   a reply of bare call objects is read as those calls (the sampled tokens are the same)
Steps (each an ordinary `agent-rl` command, all on one vLLM server):
  1. agent-rl train   GRPO per arm                                       -> RUN/{arm}/adapter
  2. agent-rl eval    per arm, in the arm's own parse: the base model and the arm's adapter (merged into
                      plain weights, each on a server of its own) on the same held-out questions and seeds
Outputs in RUN (default runs/bare_calls_study): eval-{arm}.json, curves.png (tool-use rate, accuracy,
tagged-call share, zero-variance groups per step, a line per arm), summary.json. Its last line on stdout
is summary.json. A third option, a format reward for the tags, can only pay for tags the policy samples:
the strict arm's tool-use rate is exactly its rate of tagged calls (docs/coding-recipe.md).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from recipe_steps import attempts, merged_weights, note, per_step, plot_panels, recipe_args, recipe_server, step

CONFIG = str(Path(__file__).with_name("bare_calls_study.yaml"))
SCRIPT = "examples/bare_calls_study.py"
MODEL = "qwen2.5-coder-0.5b"
ARMS = {"strict": "false", "lenient": "true"}  # arm -> model.bare_tool_calls
FIGURES = ("accuracy", "tool_use_rate", "tool_failure_rate", "turns_mean", "truncation_rate", "sampled_tokens_mean")
CURVES = (("tool-use rate (training rollouts)", "tool_use_rate"), ("accuracy", "reward/correct"),
          ("zero-variance groups (share)", "zero_variance_group_share"), ("truncation rate", "truncation_rate"))


def pipeline(args: argparse.Namespace, out: Path, wall: dict) -> dict[str, str]:
    sets = [x for s in args.set for x in ("--set", s)]
    t_server = time.perf_counter()
    runs = {}
    # a bfloat16 server beside the float32 trainer: both in float32 did not fit beside the machine's other jobs
    with recipe_server(out, max_model_len=2048, kv_cache_gib=1, model=MODEL, dtype="bfloat16") as server:
        note(wall, "server_start", time.perf_counter() - t_server)
        for arm, bare in ARMS.items():
            run_dir = out / arm
            note(wall, f"grpo_{arm}", step(run_dir / "adapter", "train", CONFIG, "--set",
                                           f"sampler.server_urls=[{server.url}]", "--set",
                                           f"model.bare_tool_calls={bare}", *sets, "--resume",
                                           "--set", f"run.run_dir={run_dir}", server=server))
            runs[arm] = str(run_dir)
    for arm, bare in ARMS.items():  # each arm in its own parse, its policy merged into plain weights
        merged = merged_weights(MODEL, Path(runs[arm]), Path(runs[arm]) / "merged")
        path = out / f"eval-{arm}.json"
        path.unlink(missing_ok=True)
        note(wall, f"eval_{arm}", step(path, "eval", CONFIG, "--set", f"model.bare_tool_calls={bare}", "--set",
                                       "model.dtype=bfloat16", *sets, "--adapter", "base", "--adapter", str(merged),
                                       "--out", str(path)))
    return runs


def main() -> None:
    args = recipe_args(__doc__.split("\n")[0], "runs/bare_calls_study", "unused: one seed (run.seed)")
    out = Path(args.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    wall: dict[str, float | None] = {}
    t_start = time.perf_counter()
    runs = attempts(lambda: pipeline(args, out, wall))
    plot_panels({arm: Path(d) for arm, d in runs.items()}, CURVES, out / "curves.png", SCRIPT,
                "Bare JSON calls read as calls (lenient) or not (strict): GRPO of Qwen2.5-Coder-0.5B, calculator")
    wall["total"] = time.perf_counter() - t_start
    summary: dict = {"wall_s": wall}
    for arm, run_dir in runs.items():
        res = json.loads((out / f"eval-{arm}.json").read_text())["results"]
        summary[arm] = {"held_out": {label: {k: r.get(k) for k in FIGURES} for label, r in res.items()},
                        "per_step": {k: per_step(Path(run_dir), key) for k, key in
                                     (("tool_use_rate", "tool_use_rate"), ("accuracy", "reward/correct"),
                                      ("zero_variance_group_share", "zero_variance_group_share"),
                                      ("step_s", "time/step_s"))}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
