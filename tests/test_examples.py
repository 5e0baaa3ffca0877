"""Every config in examples/ is runnable as written: it loads, names a registered environment whose
tasks load, and its episode budget fits its server's context."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_rl.config import load_config
from envs.registry import load_env

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def test_there_is_a_config_per_environment():
    envs = {load_config(str(p)).rollout.env for p in CONFIGS}
    assert {"calculator", "envs.math", "envs.coding", "envs.search_qa", "envs.kg_qa", "envs.gui"} <= \
        envs | {f"envs.{e}" for e in envs}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_example_config_loads_and_its_env_has_tasks(path):
    cfg = load_config(str(path))
    spec = load_env(cfg.rollout.env)
    tasks = spec.load_tasks(2, seed=cfg.run.seed, split="train")
    assert len(tasks) == 2 and len({t["id"] for t in tasks}) == 2
    assert spec.solve is not None  # a cold start is possible for every example environment
