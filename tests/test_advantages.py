"""Advantage estimators and group bookkeeping, against numbers worked out by hand."""

import math

import pytest
import torch

from agent_rl.core.types import StopReason, Trajectory, TrajectoryGroup
from agent_rl.learn.advantages import (
    dr_grpo_advantages,
    group_advantages,
    grpo_advantages,
    has_signal,
    rloo_advantages,
    usable_rewards,
)


def _close(actual, expected):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        atol=1e-6,
        rtol=0,
    )


def test_dr_grpo_by_hand():
    # mean([1,0,0,1]) = 0.5 -> [0.5, -0.5, -0.5, 0.5]
    _close(dr_grpo_advantages([1.0, 0.0, 0.0, 1.0]), [0.5, -0.5, -0.5, 0.5])
    # mean([1,0,0,0]) = 0.25 -> [0.75, -0.25, -0.25, -0.25]
    _close(dr_grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0])), [0.75, -0.25, -0.25, -0.25])


def test_grpo_uses_sample_std():
    # [1,0,0,0]: mean 0.25, deviations [.75,-.25,-.25,-.25], squares sum = .5625 + 3*.0625 = .75
    # sample var = .75 / (4-1) = .25 -> std .5 -> [1.5, -.5, -.5, -.5]
    # (population std: sqrt(.75/4) = .4330 -> 1.732 for the first: the test tells them apart)
    _close(grpo_advantages([1.0, 0.0, 0.0, 0.0], eps=0.0), [1.5, -0.5, -0.5, -0.5])
    # [1,0,0,1]: squares sum = 4 * .25 = 1, sample var 1/3, std = 0.5773502692
    # .5 / .5773502692 = sqrt(3)/2 = 0.8660254038
    h = math.sqrt(3) / 2
    _close(grpo_advantages([1.0, 0.0, 0.0, 1.0], eps=0.0), [h, -h, -h, h])


def test_grpo_eps_is_added_to_std():
    # std .5 as above; .75 / (.5 + .25) = 1.0 and -.25 / .75 = -1/3
    _close(grpo_advantages([1.0, 0.0, 0.0, 0.0], eps=0.25), [1.0, -1 / 3, -1 / 3, -1 / 3])


def test_rloo_by_hand():
    # [1,0,0,1]: r_0 - mean(0,0,1) = 1 - 1/3 = 2/3; r_1 - mean(1,0,1) = 0 - 2/3
    _close(rloo_advantages([1.0, 0.0, 0.0, 1.0]), [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # [1,0,0,0]: 1 - 0 = 1; 0 - mean(1,0,0) = -1/3
    _close(rloo_advantages([1.0, 0.0, 0.0, 0.0]), [1.0, -1 / 3, -1 / 3, -1 / 3])
    # [3, 1]: 3 - 1 = 2, 1 - 3 = -2
    _close(rloo_advantages([3.0, 1.0]), [2.0, -2.0])


@pytest.mark.parametrize("fn", [grpo_advantages, dr_grpo_advantages, rloo_advantages])
def test_single_or_uniform_group_gives_zero(fn):
    _close(fn([0.7]), [0.0])
    _close(fn([0.5, 0.5, 0.5]), [0.0, 0.0, 0.0])


# --- group level ---------------------------------------------------------------------------


def _traj(reward: float, stop: StopReason = StopReason.NO_TOOL_CALL, name: str = "") -> Trajectory:
    return Trajectory(
        task_id=name,
        token_ids=(1, 2, 3),
        loss_mask=(0, 1, 1),
        logprobs=(0.0, -0.1, -0.2),
        prompt_len=1,
        turns=(),
        messages=(),
        tool_calls=(),
        stop_reason=stop,
        reward=reward,
    )


def _groups():
    a = TrajectoryGroup(
        "a",
        (
            _traj(1.0, name="a0"),
            _traj(0.0, name="a1"),
            _traj(1.0, StopReason.ERROR, name="a2"),  # infra error: never counted
            _traj(1.0, StopReason.LENGTH, name="a3"),  # truncated (its reward must not be used)
        ),
    )
    b = TrajectoryGroup("b", tuple(_traj(1.0, name=f"b{i}") for i in range(4)))  # no variance
    c = TrajectoryGroup("c", (_traj(0.0, name="c0"), _traj(1.0, StopReason.ERROR, name="c1")))
    return [a, b, c]


def test_truncated_masked_out():
    result = group_advantages(_groups(), dr_grpo_advantages, truncated_reward=None)
    # group a usable: a0 (1), a1 (0) -> mean .5 -> [.5, -.5]
    # group b: all 1 -> dropped; group c: only c0 usable (c1 infra error) -> dropped
    assert [t.task_id for t in result.trajectories] == ["a0", "a1"]
    _close(result.advantages, [0.5, -0.5])
    assert result.num_groups == 3
    assert result.num_zero_variance_groups == 2
    assert result.num_truncated == 1
    # 10 trajectories in, 2 kept
    assert result.num_dropped_trajectories == 8


def test_truncated_given_failure_reward():
    result = group_advantages(_groups(), dr_grpo_advantages, truncated_reward=0.0)
    # group a usable: a0 (1), a1 (0), a3 (truncated -> 0) -> mean 1/3 -> [2/3, -1/3, -1/3]
    assert [t.task_id for t in result.trajectories] == ["a0", "a1", "a3"]
    _close(result.advantages, [2 / 3, -1 / 3, -1 / 3])
    assert result.num_dropped_trajectories == 7


def test_default_estimator_is_grpo():
    result = group_advantages(_groups(), truncated_reward=0.0)
    # [1, 0, 0]: mean 1/3, deviations [2/3, -1/3, -1/3], squares 4/9 + 1/9 + 1/9 = 6/9
    # sample var = (6/9)/2 = 1/3, std = .5773502692; eps 1e-6 on top
    std = math.sqrt(1 / 3) + 1e-6
    _close(result.advantages, [(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std])


def test_signal_helpers_for_dynamic_sampling():
    a, b, c = _groups()
    kept, rewards = usable_rewards(a)
    assert [t.task_id for t in kept] == ["a0", "a1"] and rewards == (1.0, 0.0)
    assert has_signal(a) and not has_signal(b) and not has_signal(c)
    # a group whose only difference is a truncated rollout: signal only with a failure reward
    d = TrajectoryGroup("d", (_traj(1.0), _traj(1.0), _traj(1.0, StopReason.MAX_TOKENS)))
    assert not has_signal(d, truncated_reward=None)
    assert has_signal(d, truncated_reward=0.0)
