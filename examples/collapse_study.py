"""The tool-use collapse, measured: GRPO on `kg_qa` in arms that differ in one thing each, all from one SFT adapter.

Arms (`--arm`, repeated; default explain and bare):
  explain  today's explanation of an empty lookup ("No entity named 'Lesoto'. Closest names: Lesotho [country] ...")
  bare     a bare `[]` instead (`rollout.env_args: {empty_results: bare}`; see tools/kg.py)
  branch   explain, with branching at the tool decision (`algorithm.tool_branches: 0.25`; docs/algorithms.md)
  gigpo    explain, with kg_qa's turn rewards on (-0.1 a failed call or empty lookup) and `algorithm.credit: gigpo`
           while training; evaluated without turn rewards, as the others (docs/credit.md)

    python examples/collapse_study.py --seeds 0 1 2      # what `make collapse-study` runs
    python examples/collapse_study.py --arm explain --arm branch --seeds 0 1 2 --set run.steps=40 \
        --set run.save_every=1 --run-dir runs/collapse_branch      # `make collapse-branch`
    python examples/collapse_study.py --arm explain --arm gigpo --seeds 0 1 2 --set run.steps=16 \
        --set run.save_every=1 --run-dir runs/kg_credit            # `make kg-credit`
    python examples/collapse_study.py --seeds 0 --set run.steps=2 --run-dir runs/collapse_try

Steps (each an ordinary `agent-rl` command in its own process, all on one vLLM server):
  1. agent-rl demos   scripted-solver demonstrations (explanatory arm; the solver never hits an empty
                      lookup, so both arms would get the same ones), sft.direct_share answering at once
  2. agent-rl sft     one LoRA adapter: the same start for both arms     -> RUN/sft/adapter
  3. agent-rl train   GRPO from it, per arm and seed                    -> RUN/{arm}-seed{S}/adapter
  4. agent-rl eval    per arm: the SFT adapter and the arm's GRPO adapters, in the arm's environment
                      (without turn rewards), on the same held-out questions and sampling seeds
Outputs in RUN (default runs/collapse_study): eval-{arm}.json, curves.png (tool-use rate,
tool-grounded answer rate, accuracy, tool-call failure rate per step; a line per arm and seed; red
triangles where the collapse alarm fired), summary.json (per arm: held-out figures of SFT and each seed,
gains, smallest gain, seed spread; per run: the curves and the steps where `alarm/tool_collapse` was up;
wall times); with other arms than explain and bare, curves-ARM-ARM.png and summary-ARM-ARM.json (so two studies can
share a folder, and the runs of the arm they share). Its last line on stdout is the summary. A step whose output
exists is skipped.

Definitions. Tool-use rate: rollouts with at least one tool call. Tool-grounded answer rate: rollouts
whose final answer names a candidate and every name it gives appears in a successful tool result of
the episode (reward part `grounded`, envs/search_qa.py). Accuracy: the right answer and no other.
Empty lookups per rollout: calls that found nothing (reward part `empty_lookups`, counted in both arms).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from recipe_steps import (
    alarm_steps,
    attempts,
    cold_start,
    evaluate_runs,
    grpo,
    note,
    per_step,
    plot_panels,
    recipe_args,
    recipe_server,
    seed_summary,
)

CONFIG = str(Path(__file__).with_name("collapse_study.yaml"))
SCRIPT = "examples/collapse_study.py"
# arm -> (rollout.env_args.empty_results, turn rewards while training, the arm's other overrides while training)
ARMS: dict[str, tuple[str, bool, tuple[str, ...]]] = {
    "explain": ("explain", False, ()), "bare": ("bare", False, ()),
    "branch": ("explain", False, ("algorithm.tool_branches=0.25",)),
    "gigpo": ("explain", True, ("algorithm.credit=gigpo",))}
FIGURES = ("accuracy", "tool_use_rate", "grounded_rate", "tool_failure_rate", "tool_calls_per_traj",
           "empty_lookups_per_traj")
CURVES = (("tool-use rate", "tool_use_rate"), ("tool-grounded answer rate", "reward/grounded"),
          ("accuracy", "reward/correct"), ("tool-call failure rate", "tool_failure_rate"))
STYLES = {"explain": {"color": "tab:blue"}, "bare": {"color": "tab:red"}, "branch": {"color": "tab:green"},
          "gigpo": {"color": "tab:purple"}}
DASHES = ("-", "--", ":", "-.")


def arm_sets(arm: str, training: bool) -> tuple[str, ...]:
    """The `--set` arguments of an arm's GRPO runs (`training`) or of its evaluation: its environment, and while
    training its turn rewards and other overrides."""
    empty, turn_rewards, overrides = ARMS[arm]
    env_args = f"{{empty_results: {empty}" + (", turn_rewards: true}" if training and turn_rewards else "}")
    return tuple(x for s in (f"rollout.env_args={env_args}", *(overrides if training else ()))
                 for x in ("--set", s))


def figures(result: dict) -> dict[str, float]:
    return {"accuracy": result["accuracy"], "tool_use_rate": result["tool_use_rate"],
            "grounded_rate": result["reward/grounded"], "tool_failure_rate": result["tool_failure_rate"],
            "tool_calls_per_traj": result["tool_calls_per_traj"],
            "empty_lookups_per_traj": result["reward/empty_lookups"]}


def run_record(run_dir: Path) -> dict:
    """A run's curves and the steps where each alarm was up."""
    curves = {name: per_step(run_dir, key) for name, key in
              (*CURVES, ("zero_variance_group_share", "zero_variance_group_share"), ("entropy", "entropy"),
               ("empty_lookups_per_traj", "reward/empty_lookups"))}
    return {"per_step": curves, "tool_collapse_alarm_steps": alarm_steps(run_dir, "alarm/tool_collapse"),
            "entropy_collapse_alarm_steps": alarm_steps(run_dir, "alarm/entropy_collapse")}


def summarise(reports: dict[str, dict], before: str, runs: dict[str, dict[int, str]], wall: dict) -> dict:
    out: dict = {"arms": {}, "wall_s": wall}
    for arm, report in reports.items():
        res = report["results"]
        summary = seed_summary(figures(res[before]), {s: figures(res[d]) for s, d in runs[arm].items()}, FIGURES)
        summary["runs"] = {s: run_record(Path(d)) for s, d in runs[arm].items()}
        out["arms"][arm] = summary
    return out


def pipeline(args: argparse.Namespace, out: Path, wall: dict) -> tuple[dict[str, dict[int, str]], dict[str, dict]]:
    """Steps 1-4 (each skipped when done); returns arm -> seed -> run folder, and arm -> eval report."""
    common = cold_start(CONFIG, out, args.set, wall)
    t_server = time.perf_counter()
    with recipe_server(out, max_model_len=2048) as server:  # only the sampling steps need it
        common += ["--set", f"sampler.server_urls=[{server.url}]"]
        note(wall, "server_start", time.perf_counter() - t_server)
        runs: dict[str, dict[int, str]] = {arm: {} for arm in args.arm}
        for seed in args.seeds:  # seed-major: a cut-short study still has every arm of its first seeds
            for arm in args.arm:
                run_dir = out / f"{arm}-seed{seed}"
                note(wall, f"{arm}_seed{seed}", grpo(common, out, run_dir, seed, server, *arm_sets(arm, True)))
                runs[arm][seed] = str(run_dir)
        reports = {}
        for arm in args.arm:
            path = out / f"eval-{arm}.json"
            note(wall, f"eval_{arm}", evaluate_runs(path, common, out, list(runs[arm].values()), server,
                                                   *arm_sets(arm, False)))
            reports[arm] = json.loads(path.read_text())
    return runs, reports


def main() -> None:
    args = recipe_args(__doc__.split("\n")[0], "runs/collapse_study", "one GRPO run per arm and seed", tuple(ARMS),
                       default_arms=("explain", "bare"))
    out = Path(args.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    wall: dict[str, float | None] = {}
    t_start = time.perf_counter()
    runs, reports = attempts(lambda: pipeline(args, out, wall))
    labels = {f"{arm} seed {s}": Path(d) for arm in runs for s, d in runs[arm].items()}
    styles = {f"{arm} seed {s}": {**STYLES[arm], "linestyle": DASHES[i % len(DASHES)]}
              for arm in runs for i, s in enumerate(runs[arm])}
    tag = "" if args.arm == ["explain", "bare"] else "-" + "-".join(args.arm)
    plot_panels(labels, CURVES, out / f"curves{tag}.png", SCRIPT,
                f"Tool-use collapse study on kg_qa: {' vs '.join(runs)} (red triangles: collapse alarm)", styles,
                "alarm/tool_collapse")
    wall["total"] = time.perf_counter() - t_start
    summary = summarise(reports, str(out / "sft"), runs, wall)
    (out / f"summary{tag}.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
