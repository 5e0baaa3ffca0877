"""Every config in examples/ is runnable as written: it loads, names registered environments whose
tasks load, and its episode budget fits its server's context."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_rl.config.file import load_config
from agent_rl.session import env_of

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def test_there_is_a_config_per_environment():
    envs = {name for p in CONFIGS for name, _ in load_config(str(p)).rollout.mixture}
    assert {"calculator", "agent_rl.envs.math", "agent_rl.envs.coding", "agent_rl.envs.search_qa",
            "agent_rl.envs.kg_qa", "agent_rl.envs.gui"} <= \
        envs | {f"envs.{e}" for e in envs}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_example_config_loads_and_its_env_has_tasks(path):
    cfg = load_config(str(path))
    spec = env_of(cfg)  # rollout.env, or the mixture of rollout.envs
    tasks = spec.load_tasks(2, seed=cfg.run.seed, split="train")
    assert len(tasks) == 2 and len({t["id"] for t in tasks}) == 2
    assert spec.solve is not None  # a cold start is possible for every example environment


def test_recipe_summary_gains_and_seed_spread_by_hand():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "examples" / "calculator_recipe.py"
    spec = importlib.util.spec_from_file_location("calculator_recipe", path)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    figures = lambda acc, tools: {"accuracy": acc, "tool_use_rate": tools, "accuracy_with_tools": 0.5,  # noqa: E731
                                  "accuracy_without_tools": 0.5, "pass@2": acc}
    report = {"results": {"sft": figures(0.25, 0.10), "s0": figures(0.75, 0.90), "s1": figures(0.50, 0.60)}}
    out = recipe.summarise(report, "sft", {0: "s0", 1: "s1"}, {"eval": 60.0})
    assert out["gain"][0]["accuracy"] == 0.5 and out["gain"][1]["accuracy"] == 0.25
    assert out["accuracy_min_gain"] == 0.25 and out["accuracy_seed_spread"] == 0.25
    assert out["tool_use_rate_min_gain"] == pytest.approx(0.5) and \
        out["tool_use_rate_seed_spread"] == pytest.approx(0.3)
    assert out["before"]["accuracy"] == 0.25 and out["wall_s"] == {"eval": 60.0}


def test_recipe_ends_with_a_table_and_where_its_files_are():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "examples" / "calculator_recipe.py"
    spec = importlib.util.spec_from_file_location("calculator_recipe", path)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    figures = lambda acc, tools: {"accuracy": acc, "pass@2": acc, "pass^2": acc / 2, "tool_use_rate": tools,  # noqa: E731
                                  "tool/attempt_share": tools, "turns_mean": 2.0, "violation/any": 0.0}
    out = Path("runs/r")
    report = {"results": {"runs/r/sft": figures(0.25, 0.5), "runs/r/grpo-seed0": figures(0.5, 1.0),
                          "runs/r/grpo-seed1": figures(0.75, 0.75)}}
    lines = recipe.ending(report, out, {0: "runs/r/grpo-seed0", 1: "runs/r/grpo-seed1"}, 521.6).splitlines()
    assert [line.split()[:3] for line in lines[1:7]] == [
        ["sft", "0.250", "0.250"], ["grpo", "seed", "0"], ["grpo", "seed", "1"], ["gain", "grpo", "seed"],
        ["gain", "grpo", "seed"], ["seed", "spread", "0.250"]]
    assert lines[4].split()[4:7] == ["+0.250", "+0.250", "+0.125"]  # seed 0 over SFT: accuracy, pass@2, pass^2
    assert lines[7:] == ["curves: runs/r/accuracy_tool_use.png", "report: runs/r/eval_before_after.json",
                         "replies: runs/r/eval_before_after.replies.jsonl "
                         "(agent-rl view runs/r/eval_before_after.replies.jsonl)",
                         "summary: runs/r/summary.json (gains, wall times: 522 s in all)"]


def _example(name: str, monkeypatch):
    import importlib.util

    folder = Path(__file__).resolve().parents[1] / "examples"
    monkeypatch.syspath_prepend(str(folder))  # the recipes import recipe_steps from their own folder
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _metrics_file(run_dir: Path, records: list[dict]) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, **r}) + "\n"
                                                   for i, r in enumerate(records)))
    return run_dir


def test_gui_recipe_figures_gains_and_spread_by_hand(tmp_path, monkeypatch):
    recipe = _example("gui_recipe", monkeypatch)
    result = lambda acc, per_solved, refused: {  # noqa: E731  (an `agent-rl eval` result, the keys read)
        "accuracy": acc, "tool_calls_per_solved": per_solved, "reward/actions": 4.0, "reward/invalid_actions": refused,
        "tool_failure_rate": 0.25, "truncation_rate": 0.0}
    runs = {s: str(_metrics_file(tmp_path / f"grpo-seed{s}", [
        {"reward/solved": 0.25, "reward/actions": 4.0, "reward/invalid_actions": 1.0, "zero_variance_group_share": 0.5,
         "truncation_rate": 0.0, "entropy": 0.4, "alarm/tool_collapse": 0.0},
        {"reward/solved": 0.75, "reward/actions": 2.0, "reward/invalid_actions": 0.0, "zero_variance_group_share": 0.25,
         "truncation_rate": 0.5, "entropy": 0.3, "alarm/tool_collapse": 1.0}])) for s in (0, 1)}
    tool = lambda text: {"role": "tool", "content": text + "\npage \"Settings\" ..."}  # noqa: E731
    (tmp_path / "grpo-seed0" / "traces").mkdir()  # seed 1 has none: no breakdown
    (tmp_path / "grpo-seed0" / "traces" / "step-000001.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "Error: not a tool message"}, tool("Saved 1 change."),
        tool("Error: e66 (Save) is disabled: nothing to save"), tool("Error: e12 (Save) is disabled: nothing to save"),
        tool("Error: no element 'e99' on the page; use an id in [brackets] from the tree")]}) + "\n")
    report = {"results": {"sft": result(0.25, 4.0, 1.0), runs[0]: result(0.75, 3.0, 0.0),
                          runs[1]: result(0.5, float("nan"), 2.0)}}
    out = recipe.summarise(report, "sft", runs, {"eval": 1.0})
    assert out["before"] == {"success": 0.25, "actions_per_solved": 4.0, "invalid_action_rate": 0.25,
                             "tool_failure_rate": 0.25, "truncation_rate": 0.0}
    assert out["gain"][0]["success"] == 0.5 and out["gain"][1]["success"] == 0.25
    assert out["success_min_gain"] == 0.25 and out["success_seed_spread"] == 0.25
    assert out["gain"][0]["actions_per_solved"] == -1.0 and out["gain"][1]["actions_per_solved"] is None  # NaN: none
    assert out["invalid_action_rate_min_gain"] == -0.25 and out["invalid_action_rate_seed_spread"] == 0.5
    d = out["diagnostics"][0]
    assert d["per_step"]["invalid_action_rate"] == [0.25, 0.0] and d["zero_variance_group_share_mean"] == 0.375
    assert d["truncation_rate_mean"] == 0.25 and d["tool_collapse_alarm_steps"] == [2]
    assert d["failed_calls_by_reason"] == {
        "Error: _ _ is disabled: nothing to save": 0.667,
        "Error: no element _ on the page; use an id in [brackets] from the tree": 0.333}
    assert out["diagnostics"][1]["failed_calls_by_reason"] == {}
    assert out["wall_s"] == {"eval": 1.0}
    png = recipe.plot_panels({"seed 0": Path(runs[0])}, recipe.CURVES, tmp_path / "c.png", recipe.SCRIPT, "t")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_collapse_study_summary_per_arm_by_hand(tmp_path, monkeypatch):
    study = _example("collapse_study", monkeypatch)
    result = lambda acc, tools, grounded: {"accuracy": acc, "tool_use_rate": tools, "reward/grounded": grounded,  # noqa: E731
                                           "tool_failure_rate": 0.1, "tool_calls_per_traj": 2 * tools,
                                           "reward/empty_lookups": 0.5}
    curve = lambda tools: {"tool_use_rate": tools, "reward/grounded": tools / 2, "reward/correct": 0.3,  # noqa: E731
                           "tool_failure_rate": 0.1, "zero_variance_group_share": 0.5, "entropy": 0.5,
                           "reward/empty_lookups": 0.25, "alarm/tool_collapse": float(tools < 0.4)}
    runs = {"explain": {0: str(_metrics_file(tmp_path / "e0", [curve(0.8), curve(0.9)]))},
            "bare": {0: str(_metrics_file(tmp_path / "b0", [curve(0.8), curve(0.3)]))}}
    reports = {"explain": {"results": {"sft": result(0.3, 0.7, 0.3), runs["explain"][0]: result(0.5, 0.9, 0.5)}},
               "bare": {"results": {"sft": result(0.2, 0.7, 0.2), runs["bare"][0]: result(0.1, 0.2, 0.0)}}}
    out = study.summarise(reports, "sft", runs, {})
    explain, bare = out["arms"]["explain"], out["arms"]["bare"]
    assert explain["gain"][0]["accuracy"] == pytest.approx(0.2) and \
        bare["gain"][0]["tool_use_rate"] == pytest.approx(-0.5)
    assert bare["grounded_rate_min_gain"] == pytest.approx(-0.2) and bare["accuracy_seed_spread"] == 0.0
    assert bare["runs"][0]["tool_collapse_alarm_steps"] == [2] and explain["runs"][0]["tool_collapse_alarm_steps"] == []
    assert bare["runs"][0]["per_step"]["tool-use rate"] == [0.8, 0.3]
    assert bare["gain"][0]["empty_lookups_per_traj"] == 0.0 and \
        bare["runs"][0]["per_step"]["empty_lookups_per_traj"] == [0.25] * 2


def test_collapse_study_arms_set_what_they_name_and_evaluate_alike(monkeypatch):
    study = _example("collapse_study", monkeypatch)
    assert study.arm_sets("bare", True) == ("--set", "rollout.env_args={empty_results: bare}")
    assert study.arm_sets("branch", True) == ("--set", "rollout.env_args={empty_results: explain}",
                                              "--set", "algorithm.tool_branches=0.25")
    assert study.arm_sets("gigpo", True) == ("--set", "rollout.env_args={empty_results: explain, turn_rewards: true}",
                                             "--set", "algorithm.credit=gigpo")
    # evaluated in the arm's environment without turn rewards or training overrides: comparable with explain's
    assert {study.arm_sets(arm, False) for arm in ("explain", "branch", "gigpo")} == {
        ("--set", "rollout.env_args={empty_results: explain}")}
    # no --arm: the study's two arms; --arm names the ones to run
    monkeypatch.setattr("sys.argv", ["collapse_study.py"])
    assert study.recipe_args("d", "runs/x", "s", tuple(study.ARMS), default_arms=("explain", "bare")).arm == [
        "explain", "bare"]
    monkeypatch.setattr("sys.argv", ["collapse_study.py", "--arm", "explain"])
    assert study.recipe_args("d", "runs/x", "s", tuple(study.ARMS), default_arms=("explain", "bare")).arm == [
        "explain"]


def test_coding_recipe_summary_by_hand(tmp_path, monkeypatch):
    recipe = _example("coding_recipe", monkeypatch)

    def result(pass1, tools):
        # tool_use_rate: episodes with any tool call; reward/ran_tests: those that ran the visible tests
        return {"accuracy": pass1, "pass@2": pass1 + 0.125, "reward/tests_passed": 0.5, "reward/ran_tests": tools,
                "reward/revised_after_failure": tools / 2, "tool_use_rate": tools + 0.125, "turns_mean": 1.5,
                "sampled_tokens_mean": 200.0, "reward/submitted": 1.0, "reward/compiled": 0.75,
                "truncation_rate": 0.0}

    runs = {}
    for seed, solved in ((0, [0.25, 0.5]), (1, [0.125, 0.25])):
        runs[seed] = tmp_path / f"grpo-seed{seed}"
        runs[seed].mkdir()
        (runs[seed] / "metrics.jsonl").write_text("".join(
            json.dumps({"step": i + 1, "reward/solved": s, "reward/ran_tests": s / 2, "tool_use_rate": s,
                        "time/step_s": 300.0, "time/wait_s": 100.0, "time/train_s": 50.0, "train_tokens": 1000.0,
                        "rollouts": 16.0, "sampled_tokens_mean": 250.0}) + "\n" for i, s in enumerate(solved)))
    # seed 0's traced submissions: step 1 one with inline asserts that did not load, one without that did;
    # step 2 one with asserts that loaded, and an episode that submitted nothing (not counted)
    episodes = {1: [("x = 1\nassert f(1) == 2", 1.0, 0.0), ("def f(x): return 2", 1.0, 1.0)],
                2: [("assert f(1) == 2", 1.0, 1.0), ("no code", 0.0, 0.0)]}
    traces = runs[0] / "traces"
    traces.mkdir()
    for step, records in episodes.items():
        (traces / f"step-{step:06d}.jsonl").write_text("".join(json.dumps(
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}],
             "reward_parts": {"submitted": submitted, "compiled": compiled}}) + "\n"
            for text, submitted, compiled in records))
    merged = {s: str(d / "merged") for s, d in runs.items()}  # how the recipe evaluates each run's policy
    report = {"results": {"base": result(0.25, 0.0), merged[0]: result(0.5, 0.75), merged[1]: result(0.375, 0.25)}}
    summary = recipe.summarise(report, {"grpo": merged}, {"eval": 60.0})
    out = summary["arms"]["grpo"]
    assert out["gain"][0]["pass@1"] == 0.25 and out["gain"][1]["pass@1"] == 0.125
    assert out["pass@1_min_gain"] == 0.125 and out["pass@1_seed_spread"] == 0.125
    assert out["tool_use_rate_min_gain"] == 0.25 and out["tool_use_rate_seed_spread"] == 0.5
    assert out["before"]["tool_use_rate"] == 0.0 and out["before"]["any_tool_call_rate"] == 0.125
    assert out["after"][0]["compiled"] == 0.75
    assert out["diagnostics"][0]["per_step"]["tool_use_rate"] == [0.125, 0.25]
    assert out["diagnostics"][0]["per_step"]["any_tool_call_rate"] == [0.25, 0.5]
    assert out["diagnostics"][1]["rollout_wait_s_mean"] == 100.0
    # 2,000 tokens trained in 100 s of update; 2 x 16 x 250 sampled in 200 s of waiting for rollouts
    assert out["diagnostics"][0]["trainer_tok_s"] == 20.0 and out["diagnostics"][0]["sampled_tok_per_wait_s"] == 40.0
    assert out["diagnostics"][0]["inline_asserts"] == {"share_per_step": [0.5, 1.0], "submissions": 3,
                                                       "loaded_with": 0.5, "loaded_without": 1.0}
    assert out["diagnostics"][1]["inline_asserts"] == {}  # no traces
    assert out["before"]["pass@2"] == 0.375 and summary["wall_s"] == {"eval": 60.0}
    # the targets: ran the tests >= 0.6 (0.75, 0.25), revised after a failure >= 0.2 (0.375, 0.125), tool use at
    # the last step >= the first (0.125 -> 0.25, 0.0625 -> 0.125)
    assert out["targets"] == {0: {"ran_tests_ge_0.6": True, "revised_ge_0.2": True, "tool_use_last_ge_first": True},
                              1: {"ran_tests_ge_0.6": False, "revised_ge_0.2": False,
                                  "tool_use_last_ge_first": True}}
    assert out["diagnostics"][0]["per_step"]["solved"] == [0.25, 0.5] and out["diagnostics"][1]["solved_mean"] == 0.1875
    assert out["diagnostics"][0]["step_s_mean"] == 300.0 and out["diagnostics"][0]["entropy_mean"] is None
