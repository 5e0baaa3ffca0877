"""Every config in examples/ is runnable as written: it loads, names registered environments whose
tasks load, and its episode budget fits its server's context."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_rl.core.config_file import load_config
from agent_rl.session import env_of

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def test_there_is_a_config_per_environment():
    envs = {name for p in CONFIGS for name, _ in load_config(str(p)).rollout.mixture}
    assert {"calculator", "envs.math", "envs.coding", "envs.search_qa", "envs.kg_qa", "envs.gui"} <= \
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
    assert out["tool_use_rate_min_gain"] == pytest.approx(0.5) and out["tool_use_rate_seed_spread"] == pytest.approx(0.3)
    assert out["before"]["accuracy"] == 0.25 and out["wall_s"] == {"eval": 60.0}
