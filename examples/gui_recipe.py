"""The GUI-agent recipe: imperfect demonstrations, cold-start SFT, GRPO over seeds, held-out evaluation,
on the `gui` environment (settings page, click / type / select / scroll) with SmolLM2-135M-Instruct.

    python examples/gui_recipe.py --seeds 0 1 2        # what `make gui-recipe` runs
    python examples/gui_recipe.py --seeds 0 --set run.steps=2 --run-dir runs/gui_try   # a quick look

Steps (each an ordinary `agent-rl` command in its own process, all on one vLLM server):
  1. agent-rl demos   scripted-solver demonstrations; sft.imperfect_share of them slip once (an
                      unrelated click, the wrong tool, an unknown element id) and then repair it
  2. agent-rl sft     LoRA adapter on them                            -> RUN/sft/adapter
  3. agent-rl train   GRPO from that adapter, once per seed           -> RUN/grpo-seed{S}/adapter
  4. agent-rl eval    the SFT and every GRPO adapter on the same held-out tasks and sampling seeds
Outputs in RUN (default runs/gui_recipe): eval.json (step 4's report), curves.png (training curves, a
line per seed), summary.json (per adapter: success rate, actions per solved task, invalid-action
rate, tool-call failure rate; per seed the gain over SFT; the smallest gain and the seed spread; per
seed the training diagnostics: zero-variance groups, truncation, alarms, failed tool calls by reason;
wall times). Its last line on stdout is summary.json. A step whose output exists is skipped (delete
RUN to start over).

Definitions. Success: the saved settings equal the goal (reward 1). Actions per solved task: tool calls
of the solved rollouts, failed ones included. Invalid-action rate: page actions the page refused
(unknown or hidden element, wrong tool for it, disabled) / page actions. Tool-call failure rate: failed
calls / calls, for any reason (malformed JSON, unknown tool, bad arguments, refused action).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter
from pathlib import Path

from recipe_steps import (
    alarm_steps,
    attempts,
    cold_start,
    evaluate_runs,
    finite,
    grpo,
    mean,
    note,
    per_step,
    plot_panels,
    ratio,
    recipe_args,
    recipe_server,
    seed_summary,
)

CONFIG = str(Path(__file__).with_name("gui_recipe.yaml"))
SCRIPT = "examples/gui_recipe.py"
FIGURES = ("success", "actions_per_solved", "invalid_action_rate", "tool_failure_rate", "truncation_rate")
CURVES = (("success rate (training rollouts)", "reward/solved"),
          ("invalid-action rate", ratio("reward/invalid_actions", "reward/actions")),
          ("tool-call failure rate", "tool_failure_rate"),
          ("zero-variance groups (share)", "zero_variance_group_share"),
          ("truncation rate", "truncation_rate"),
          ("progress (share of asked changes saved)", "reward/progress"))


def figures(result: dict) -> dict[str, float | None]:
    """The recipe's figures of one adapter from its `agent-rl eval` result."""
    actions = result.get("reward/actions")
    return {"success": result["accuracy"], "actions_per_solved": finite(result.get("tool_calls_per_solved")),
            "invalid_action_rate": result["reward/invalid_actions"] / actions if actions else None,
            "tool_failure_rate": result["tool_failure_rate"], "truncation_rate": result["truncation_rate"]}


def failed_calls_by_reason(run_dir: Path, top: int = 5) -> dict[str, float]:
    """Share of the failed tool calls in a run's traced groups (`run.trace_groups`, chosen with a
    failure where any) by reason: the tool message's first line, element ids and quoted text blanked."""
    from agent_rl.runs.traces import TraceError, read_traces

    try:
        traced = read_traces(run_dir)
    except TraceError:  # run.trace_groups: 0
        return {}
    reasons = Counter(re.sub(r"'[^']*'|\([^)]*\)|\be\d+\b", "_", m["content"].splitlines()[0])[:80]
                      for records in traced.values() for t in records for m in t["messages"]
                      if m["role"] == "tool" and m["content"].startswith("Error"))
    total = sum(reasons.values())
    return {why: round(n / total, 3) for why, n in reasons.most_common(top)} if total else {}


def diagnostics(run_dir: Path) -> dict:
    """Why a run did or did not learn, from its training curves."""
    curves = {name: per_step(run_dir, key) for name, key in
              (("success", "reward/solved"), ("zero_variance_group_share", "zero_variance_group_share"),
               ("truncation_rate", "truncation_rate"), ("entropy", "entropy"),
               ("invalid_action_rate", ratio("reward/invalid_actions", "reward/actions")))}
    return {"per_step": curves, **{f"{k}_mean": mean(v) for k, v in curves.items()},
            "failed_calls_by_reason": failed_calls_by_reason(run_dir),
            "tool_collapse_alarm_steps": alarm_steps(run_dir, "alarm/tool_collapse"),
            "entropy_collapse_alarm_steps": alarm_steps(run_dir, "alarm/entropy_collapse")}


def summarise(report: dict, before: str, after: dict[int, str], wall: dict) -> dict:
    res = report["results"]
    out = seed_summary(figures(res[before]), {s: figures(res[label]) for s, label in after.items()}, FIGURES)
    out["diagnostics"] = {s: diagnostics(Path(label)) for s, label in after.items()}
    out["wall_s"] = wall
    return out


def pipeline(args: argparse.Namespace, out: Path, wall: dict) -> dict[int, str]:
    """Steps 1-4 (each skipped when done); returns seed -> GRPO run folder."""
    common = cold_start(CONFIG, out, args.set, wall)
    t_server = time.perf_counter()
    with recipe_server(out, max_model_len=3072) as server:  # only the sampling steps need it
        common += ["--set", f"sampler.server_urls=[{server.url}]"]
        note(wall, "server_start", time.perf_counter() - t_server)
        after = {}
        for seed in args.seeds:
            run_dir = out / f"grpo-seed{seed}"
            note(wall, f"grpo_seed{seed}", grpo(common, out, run_dir, seed, server))
            after[seed] = str(run_dir)
        note(wall, "eval", evaluate_runs(out / "eval.json", common, out, list(after.values()), server))
    return after


def main() -> None:
    args = recipe_args(__doc__.split("\n")[0], "runs/gui_recipe", "one GRPO run per seed, all from one SFT")
    out = Path(args.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    wall: dict[str, float | None] = {}
    t_start = time.perf_counter()
    after = attempts(lambda: pipeline(args, out, wall))
    plot_panels({f"seed {s}": Path(d) for s, d in after.items()}, CURVES, out / "curves.png", SCRIPT,
                f"GUI recipe: GRPO from the SFT adapter, {len(after)} seed(s)")
    wall["total"] = time.perf_counter() - t_start
    summary = summarise(json.loads((out / "eval.json").read_text()), str(out / "sft"), after, wall)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
