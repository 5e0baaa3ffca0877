"""The coding-agent recipe: Qwen2.5-Coder-0.5B-Instruct straight into GRPO on `coding_tests` (write a
function, run its visible tests, fix, submit; hidden tests grade), over seeds, with held-out evaluation
of the base model and every GRPO adapter on the same problems and sampling seeds.

    python examples/coding_recipe.py --seeds 0 1 2        # what `make coding-recipe` runs (the grpo arm)
    python examples/coding_recipe.py --arm bootstrap --arm bootstrap-branch --seeds 0 1 2 \
        --run-dir runs/coding_tool_use                     # `make coding-tool-use`: docs/coding-recipe.md
    python examples/coding_recipe.py --seeds 0 --set run.steps=1 --run-dir runs/coding_try   # a quick look

Arms: `grpo` (GRPO from the base model), `bootstrap` (GRPO from a cold start bootstrapped from the policy's own
episodes), `bootstrap-branch` (the same with branching at the tool decision, `algorithm.tool_branches: 0.25`).
Steps (each an ordinary `agent-rl` command in its own process):
  0. agent-rl bootstrap  (bootstrap arms) the base model plays training problems with the opening of a
                      `run_tests` call forced at its first turn; the episodes that ran the tests and solved their
                      problem become demonstrations without the help                -> RUN/bootstrap/demos.jsonl
     agent-rl sft     a LoRA adapter on them                                        -> RUN/bootstrap/sft/adapter
  1. agent-rl train   GRPO once per arm and seed, from the base model or the SFT adapter, all on one vLLM server
                      (bfloat16; the trainer float32)                               -> RUN/{arm}-seed{S}/adapter
  2. agent-rl eval    the base model, the SFT adapter and every GRPO adapter, merged into plain weights
                      (RUN/{arm}-seed{S}/merged: vLLM's CPU build samples a 0.5B model far slower through a LoRA
                      adapter: docs/coding-recipe.md), each on a server of its own, on the same held-out
                      problems and sampling seeds, without any help
Outputs in RUN (default runs/coding_recipe): eval.json (step 2's report), curves.png (training curves, a
line per seed), summary.json (per policy: pass@1, pass@2, hidden-test share, tool-use rate, turns and
tokens per episode; per seed the gain over the base model; the smallest gain and the seed spread; per
seed the training diagnostics; wall times). Its last line on stdout is summary.json. A step whose output
exists is skipped (delete RUN to start over).

Definitions. pass@1: rollouts whose submission passed every hidden test / rollouts (`agent-rl eval`'s
accuracy at success threshold 1: the reward is 0.5 x all pass + 0.5 x the share, so 1 only when all
pass); pass@2 per problem, the unbiased estimator. Hidden-test share: the mean share of hidden tests
passed. Tool-use rate: episodes that ran the visible tests (`run_tests`, the one tool) before submitting;
any-tool-call rate: episodes with any tool call (a call to an unknown tool, such as the function to be written
called as if it were a tool, counts there and not above). Compiled: submissions that loaded and ran.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from recipe_steps import (
    alarm_steps,
    attempts,
    mean,
    merged_weights,
    note,
    per_step,
    plot_panels,
    recipe_args,
    recipe_server,
    seed_summary,
    step,
)

from agent_rl.runs.runlog import read_metrics

CONFIG = str(Path(__file__).with_name("coding_recipe.yaml"))
SCRIPT = "examples/coding_recipe.py"
MODEL = "qwen2.5-coder-0.5b"
FIGURES = ("pass@1", "pass@2", "tests_passed", "tool_use_rate", "revised_after_failure", "any_tool_call_rate",
           "turns_mean", "sampled_tokens_mean", "submitted", "compiled", "truncation_rate")
ARMS = {"grpo": (), "bootstrap": (), "bootstrap-branch": ("--set", "algorithm.tool_branches=0.25")}
BOOTSTRAP = ("--force-call", "--tasks", "64", "--samples", "2")  # 128 helped episodes of training problems
CURVES = (("pass@1: all hidden tests pass (training rollouts)", "reward/solved"),
          ("share of hidden tests passed", "reward/tests_passed"),
          ("visible tests run before submitting (tool-use rate)", "reward/ran_tests"),
          ("zero-variance groups (share)", "zero_variance_group_share"),
          ("submitted a code block", "reward/submitted"),
          ("truncation rate", "truncation_rate"))


def figures(result: dict) -> dict[str, float | None]:
    """The recipe's figures of one policy from its `agent-rl eval` result."""
    return {"pass@1": result["accuracy"], "pass@2": result.get("pass@2"),
            "tests_passed": result.get("reward/tests_passed"), "tool_use_rate": result.get("reward/ran_tests"),
            "revised_after_failure": result.get("reward/revised_after_failure"),
            "any_tool_call_rate": result["tool_use_rate"], "turns_mean": result["turns_mean"],
            "sampled_tokens_mean": result["sampled_tokens_mean"], "submitted": result.get("reward/submitted"),
            "compiled": result.get("reward/compiled"), "truncation_rate": result["truncation_rate"]}


def inline_asserts(run_dir: Path) -> dict:
    """The traced submissions (`run.trace_groups`) that carry the visible tests as `assert` statements, which
    fail as a wrong program loads: their share per step, and how often a submission loaded with and without."""
    from agent_rl.runs.traces import TraceError, read_traces

    try:
        traced = read_traces(run_dir)
    except TraceError:  # run.trace_groups: 0
        return {}
    per_step, loaded = [], {True: [], False: []}
    for step_records in (traced[s] for s in sorted(traced)):
        subs = [("assert " in (t["messages"][-1].get("content") or ""), t["reward_parts"].get("compiled", 0.0))
                for t in step_records if t["reward_parts"].get("submitted")]
        per_step.append(mean([float(a) for a, _ in subs]))
        for has, compiled in subs:
            loaded[has].append(compiled)
    return {"share_per_step": per_step, "submissions": len(loaded[True]) + len(loaded[False]),
            "loaded_with": mean(loaded[True]), "loaded_without": mean(loaded[False])}


def rates(run_dir: Path) -> dict[str, float | None]:
    """Tokens per second over the run: trained per second of the update, sampled per second of rollout wait."""
    steps = read_metrics(run_dir)
    train_s, wait_s = sum(r.get("time/train_s", 0.0) for r in steps), sum(r.get("time/wait_s", 0.0) for r in steps)
    trained = sum(r.get("train_tokens", 0.0) for r in steps)
    sampled = sum(r.get("rollouts", 0.0) * r.get("sampled_tokens_mean", 0.0) for r in steps)
    return {"trainer_tok_s": trained / train_s if train_s else None,
            "sampled_tok_per_wait_s": sampled / wait_s if wait_s else None}


def diagnostics(run_dir: Path) -> dict:
    """Why a run did or did not learn, from its training curves."""
    curves = {name: per_step(run_dir, key) for name, key in
              (("solved", "reward/solved"), ("tests_passed", "reward/tests_passed"),
               ("tool_use_rate", "reward/ran_tests"), ("any_tool_call_rate", "tool_use_rate"),
               ("zero_variance_group_share", "zero_variance_group_share"),
               ("truncation_rate", "truncation_rate"), ("entropy", "entropy"), ("step_s", "time/step_s"),
               ("rollout_wait_s", "time/wait_s"), ("train_s", "time/train_s"), ("sync_s", "time/sync_s"))}
    return {"per_step": curves, **{f"{k}_mean": mean(v) for k, v in curves.items()}, **rates(run_dir),
            "inline_asserts": inline_asserts(run_dir),
            "tool_collapse_alarm_steps": alarm_steps(run_dir, "alarm/tool_collapse"),
            "entropy_collapse_alarm_steps": alarm_steps(run_dir, "alarm/entropy_collapse")}


def summarise(report: dict, after: dict[str, dict[int, str]], wall: dict) -> dict:
    """`after`: arm -> seed -> the label its policy has in `report` (its run's merged weights:
    RUN/{arm}-seedS/merged). Per arm, its seeds against the base model (and, for the bootstrap arms, against the
    SFT adapter), the training diagnostics per seed, and the targets of docs/coding-recipe.md#tool-use-that-holds."""
    res = report["results"]
    out: dict = {"arms": {}, "wall_s": wall}
    sft = next((label for label in res if label.endswith("bootstrap/sft")), None)
    for arm, seeds in after.items():
        summary = seed_summary(figures(res["base"]), {s: figures(res[label]) for s, label in seeds.items()}, FIGURES)
        if sft is not None and arm != "grpo":
            summary["sft"] = figures(res[sft])
        summary["diagnostics"] = {s: diagnostics(Path(label).parent) for s, label in seeds.items()}
        summary["targets"] = targets(summary)
        out["arms"][arm] = summary
    return out


def targets(summary: dict) -> dict:
    """docs/coding-recipe.md's targets, per seed: held-out episodes that ran the visible tests before submitting
    >= 0.6; that changed their code after a failing run >= 0.2; tool use at the last training step >= at the
    first (pass@1 against the GRPO-only arm is read beside its table there)."""
    out = {}
    for seed, after in summary["after"].items():
        curve = [x for x in summary["diagnostics"][seed]["per_step"]["tool_use_rate"] if x is not None]
        out[seed] = {"ran_tests_ge_0.6": (after["tool_use_rate"] or 0.0) >= 0.6,
                     "revised_ge_0.2": (after["revised_after_failure"] or 0.0) >= 0.2,
                     "tool_use_last_ge_first": bool(curve) and curve[-1] >= curve[0]}
    return out


def bootstrapped(out: Path, common: list[str], server, wall: dict) -> str:
    """Step 0 (each part skipped when done): the demonstrations and the SFT adapter; returns the SFT's run dir."""
    demos = out / "bootstrap" / "demos.jsonl"
    note(wall, "bootstrap", step(demos, "bootstrap", *common, *BOOTSTRAP, "--out", str(demos), server=server))
    sft_dir = out / "bootstrap" / "sft"
    note(wall, "sft", step(sft_dir / "adapter", "sft", *common, "--set", f"sft.demos={demos}",
                           "--set", f"sft.run_dir={sft_dir}", "--resume"))
    return str(sft_dir)


def pipeline(args: argparse.Namespace, out: Path, wall: dict) -> dict[str, dict[int, str]]:
    """Steps 0-2 (each skipped when done); returns arm -> seed -> the merged weights of its GRPO run."""
    sets = [x for s in args.set for x in ("--set", s)]
    t_server = time.perf_counter()
    # bfloat16 sampling: the float32 server and trainer did not both fit beside the machine's other
    # jobs (the kernel killed the server three times); the trainer stays float32, the truncated importance
    # weights (algorithm.tis_cap) correct for the gap
    runs: dict[str, dict[int, Path]] = {}
    with recipe_server(out, max_model_len=4096, kv_cache_gib=1, model=MODEL, dtype="bfloat16") as server:
        common = [CONFIG, "--set", f"sampler.server_urls=[{server.url}]", *sets]
        note(wall, "server_start", time.perf_counter() - t_server)
        sft = bootstrapped(out, common, server, wall) if set(args.arm) - {"grpo"} else None
        for arm in args.arm:
            start = [] if arm == "grpo" else ["--set", f"model.init_adapter={sft}/adapter"]
            runs[arm] = {}
            for seed in args.seeds:
                run_dir = out / (f"{arm}-seed{seed}" if arm != "grpo" else f"grpo-seed{seed}")
                note(wall, f"{arm}_seed{seed}", step(run_dir / "adapter", "train", *common, *start, *ARMS[arm],
                                                     "--resume", "--set", f"run.run_dir={run_dir}",
                                                     "--set", f"run.seed={seed}", server=server))
                runs[arm][seed] = run_dir
    # step 2 on servers of its own, one per policy: each GRPO adapter merged into plain weights
    t_merge = time.perf_counter()
    merged = {arm: {s: str(merged_weights(MODEL, d, d / "merged")) for s, d in seeds.items()}
              for arm, seeds in runs.items()}
    note(wall, "merge", time.perf_counter() - t_merge)
    (out / "eval.json").unlink(missing_ok=True)  # always evaluate what is there now
    labels = ["base", *([sft] if sft else []), *[m for seeds in merged.values() for m in seeds.values()]]
    policies = [x for a in labels for x in ("--adapter", a)]
    note(wall, "eval", step(out / "eval.json", "eval", CONFIG, "--set", "model.dtype=bfloat16", *sets, *policies,
                            "--out", str(out / "eval.json")))
    return merged


def main() -> None:
    args = recipe_args(__doc__.split("\n")[0], "runs/coding_recipe", "one GRPO run per seed and arm",
                       arms=tuple(ARMS))
    out = Path(args.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    wall: dict[str, float | None] = {}
    t_start = time.perf_counter()
    after = attempts(lambda: pipeline(args, out, wall))
    runs = {f"{arm} seed {s}": Path(d).parent for arm, seeds in after.items() for s, d in seeds.items()}
    plot_panels(runs, CURVES, out / "curves.png", SCRIPT,
                f"Coding recipe: GRPO of {MODEL} on coding_tests, arms {', '.join(after)}")
    wall["total"] = time.perf_counter() - t_start
    summary = summarise(json.loads((out / "eval.json").read_text()), after, wall)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
