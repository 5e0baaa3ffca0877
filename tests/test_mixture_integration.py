"""Real training runs against the test vLLM server: two environments mixed (per-environment metrics, an exact
resume), and a run whose groups an LLM judge on the run's own server ranks."""

from __future__ import annotations

import asyncio
import json

import pytest
from helpers import killed_after_step_2, server_config

from agent_rl import trainer

pytestmark = pytest.mark.integration
MIXED = {"rollout.env": "null", "rollout.envs": "{toy: 1, half_flat_env: 1}"}


def lines(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_environments_mixed_resume_at_the_same_positions(tmp_path, vllm_server, monkeypatch):
    straight = tmp_path / "straight"
    asyncio.run(trainer.train(server_config(vllm_server, straight, steps=3, **MIXED)))

    killed = tmp_path / "killed"
    killed_after_step_2(monkeypatch, server_config(vllm_server, killed, steps=3, **MIXED))
    asyncio.run(trainer.train(server_config(vllm_server, killed, steps=3, **MIXED), resume=True))

    runs = lines(straight)
    # two tasks a step, one from each environment (weights 1:1), four rollouts each
    assert [(x["data_position"], x["data_position/toy"], x["data_position/half_flat_env"]) for x in runs] == \
        [(2.0, 1.0, 1.0), (4.0, 2.0, 2.0), (6.0, 3.0, 3.0)]
    for x in runs:
        assert x["env/toy/rollouts"] == 4 and x["env/half_flat_env/rollouts"] == 4
        assert 0.0 <= x["env/toy/reward_mean"] < 1.0  # the toy's dense reward: 1 - characters / 200
        assert x["env/toy/tool_use_rate"] == 0.0
        assert x["env/toy/infra_error_rate"] == 0.0 and x["env/half_flat_env/infra_error_rate"] == 0.0
        assert x["reward_mean"] == pytest.approx((x["env/toy/reward_mean"] + x["env/half_flat_env/reward_mean"]) / 2)
    # half_flat_env's tasks 0 and 2 (steps 1 and 3) earn 1.0 whatever the answer
    flat = [(x["env/half_flat_env/reward_mean"], x["env/half_flat_env/accuracy"]) for x in runs[::2]]
    assert flat == [(1.0, 1.0)] * 2

    def per_step(run_dir):
        keep = ("step", "data_position", "data_position/toy", "data_position/half_flat_env", "env/toy/reward_mean",
                "env/half_flat_env/reward_mean", "reward_mean")
        return [{k: x[k] for k in keep} for x in lines(run_dir)]

    assert per_step(killed) == per_step(straight)


def test_a_judge_on_the_runs_own_server_ranks_every_group(tmp_path, vllm_server):
    """The tiny model is no judge (its replies are empty): every group is scored neutral, with the reason
    logged, and the run trains on; the prompt and the cached replies are in the run directory."""
    run_dir = tmp_path / "judged"
    final = asyncio.run(trainer.train(server_config(vllm_server, run_dir, steps=1, **{
        "judge.url": "run", "judge.weight": "0.5", "judge.max_tokens": "8"})))
    assert final["reward/judge"] == 0.5 and final["reward/judge_failed"] == 1.0
    assert final["reward_mean"] == pytest.approx(final["reward/episode_reward"] + 0.25)
    assert final["train_tokens"] > 0  # neutral scores change no advantage: the toy's reward still trains
    assert (run_dir / "judge" / "prompt.txt").read_text().startswith("You are grading {n} answers")
    assert len((run_dir / "judge" / "cache.jsonl").read_text().splitlines()) == 2  # one request per group
