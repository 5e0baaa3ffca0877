"""Rollout metrics against hand counts."""

import pytest

from agent_rl.core.types import StopReason, ToolCallRecord, Trajectory, Turn
from agent_rl.runs.metrics import rollout_metrics


def traj(calls=(), stop=StopReason.NO_TOOL_CALL, reward=0.0, n_tokens=10, sampled=4, turns=1):
    mask = (0,) * (n_tokens - sampled) + (1,) * sampled
    return Trajectory("t", (7,) * n_tokens, mask, (0.0,) * n_tokens, n_tokens - sampled,
                      tuple(Turn(0, 1, "stop", 0) for _ in range(turns)), (), tuple(calls), stop, reward)


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
