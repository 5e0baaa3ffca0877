"""Rollout metrics against hand counts."""

import dataclasses

import pytest
from helpers import trajectory

from agent_rl.core.types import Segment, StopReason, ToolCallRecord, Turn
from agent_rl.runs.metrics import lag_metrics, rollout_metrics


def traj(calls=(), stop=StopReason.NO_TOOL_CALL, reward=0.0, n_tokens=10, sampled=4, turns=1):
    """`n_tokens` tokens, the last `sampled` of them sampled, in `turns` turns."""
    return trajectory(reward, stop, ids=(7,) * n_tokens, prompt_len=n_tokens - sampled, logprobs=(0.0,) * n_tokens,
                      turns=[0.0] * turns, calls=calls)


def call(name, ok=True, latency=0.1):
    return ToolCallRecord(name, ok, None if ok else "bad", latency, 0)


def test_rollout_metrics_by_hand():
    ts = [
        traj([call("calc"), call("calc", ok=False, latency=0.3)], reward=1.0, turns=3),  # 2 calls, 1 failed
        traj([call("search")], reward=0.0, turns=2),
        traj([], reward=1.0, stop=StopReason.LENGTH, n_tokens=20, sampled=10),
        traj([], reward=0.0),
        traj([], stop=StopReason.ERROR),  # infra error: counted, kept out of the rates
    ]
    m = rollout_metrics(ts)
    assert m["rollouts"] == 5
    assert m["infra_error_rate"] == pytest.approx(1 / 5)
    assert m["tool_use_rate"] == pytest.approx(2 / 4)
    assert m["tool_calls_per_traj"] == pytest.approx(3 / 4)
    assert m["tool_failure_rate"] == pytest.approx(1 / 3)
    assert m["tool/calc/calls_per_traj"] == pytest.approx(2 / 4)
    assert m["tool/calc/failure_rate"] == pytest.approx(1 / 2)
    assert m["tool/calc/latency_mean_s"] == pytest.approx(0.2)
    assert m["tool/search/failure_rate"] == 0.0
    assert m["turns_mean"] == pytest.approx((3 + 2 + 1 + 1) / 4)
    assert m["tokens_mean"] == pytest.approx((10 + 10 + 20 + 10) / 4)
    assert m["sampled_tokens_mean"] == pytest.approx((4 + 4 + 10 + 4) / 4)
    assert m["truncation_rate"] == pytest.approx(1 / 4)
    assert m["reward_mean"] == pytest.approx(0.5)
    assert m["reward_time_sum_s"] == 0.0
    assert m["stop/no_tool_call"] == pytest.approx(3 / 5)
    assert m["stop/length"] == pytest.approx(1 / 5) and m["stop/error"] == pytest.approx(1 / 5)


def test_all_infra_errors_give_no_behaviour_rates():
    m = rollout_metrics([traj(stop=StopReason.ERROR)])
    assert m == {"rollouts": 1.0, "infra_error_rate": 1.0}


def test_lag_counts_each_token_with_the_version_that_sampled_it():
    """At step 5: a closed segment of 2 tokens by version 3 (lag 2); the open one 6 sampled tokens, the first 2 by
    version 3, the other 4 by 4 (a push in the middle of the turn: lag 1), and 2 context tokens (not counted).
    Tokens: 4 at lag 2, 4 at lag 1: mean 1.5, max 2, shares 1/2 each. By the turn's version (3) alone every
    token would be lag 2."""
    closed = Segment((1, 2, 3), (0, 1, 1), (0.0, -1.0, -1.0), (-1, 3, 3))
    t = trajectory(ids=(7,) * 8, prompt_len=2, logprobs=(0.0,) * 8, turns=[Turn(2, 8, "stop", 3)], policy_version=3,
                   segments=(closed,), versions=(-1, -1, 3, 3, 4, 4, 4, 4))
    assert lag_metrics([t], 5) == {"lag/mean": 1.5, "lag/max": 2.0, "lag/share_1": 0.5, "lag/share_2": 0.5}
    # versions not known (-1 on a sampled token): the trajectory's
    old = Segment((1, 2), (0, 1), (0.0, -1.0))
    assert lag_metrics([dataclasses.replace(t, segments=(old,))], 5)["lag/share_2"] == 3 / 7  # 1 + 2 of 7
