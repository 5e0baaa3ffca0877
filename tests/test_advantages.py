"""Advantage estimators and group bookkeeping, against numbers worked out by hand."""

import math

import pytest
import torch
from helpers import scored_groups, trajectory

from agent_rl.core.returns import episode_return
from agent_rl.core.types import Return, StopReason, TrajectoryGroup
from agent_rl.learn.advantages import (
    dr_grpo_advantages,
    group_advantages,
    grpo_advantages,
    has_signal,
    rloo_advantages,
    usable,
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


def _groups(truncated_reward=None):
    a = TrajectoryGroup(
        "a",
        (
            trajectory(1.0, task_id="a0"),
            trajectory(0.0, task_id="a1"),
            trajectory(1.0, StopReason.ERROR, task_id="a2"),  # infra error: never counted
            trajectory(1.0, StopReason.LENGTH, task_id="a3"),  # truncated (its reward must not be used)
        ),
    )
    b = TrajectoryGroup("b", tuple(trajectory(1.0, task_id=f"b{i}") for i in range(4)))  # no variance
    c = TrajectoryGroup("c", (trajectory(0.0, task_id="c0"), trajectory(1.0, StopReason.ERROR, task_id="c1")))
    return scored_groups([a, b, c], truncated_reward)


def test_truncated_masked_out():
    result = group_advantages(_groups(truncated_reward=None), dr_grpo_advantages)
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
    result = group_advantages(_groups(truncated_reward=0.0), dr_grpo_advantages)
    # group a usable: a0 (1), a1 (0), a3 (truncated -> 0) -> mean 1/3 -> [2/3, -1/3, -1/3]
    assert [t.task_id for t in result.trajectories] == ["a0", "a1", "a3"]
    _close(result.advantages, [2 / 3, -1 / 3, -1 / 3])
    assert result.num_dropped_trajectories == 7


def test_default_estimator_is_grpo():
    result = group_advantages(_groups(truncated_reward=0.0))
    # [1, 0, 0]: mean 1/3, deviations [2/3, -1/3, -1/3], squares 4/9 + 1/9 + 1/9 = 6/9
    # sample var = (6/9)/2 = 1/3, std = .5773502692; eps 1e-6 on top
    std = math.sqrt(1 / 3) + 1e-6
    _close(result.advantages, [(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std])


def test_signal_helpers_for_dynamic_sampling():
    a, b, c = _groups()
    kept, returns = usable(a)
    assert [t.task_id for t in kept] == ["a0", "a1"] and [r.value for r in returns] == [1.0, 0.0]
    assert has_signal(a) and not has_signal(b) and not has_signal(c)
    # a group whose only difference is a truncated rollout: signal only with a failure reward
    d = TrajectoryGroup("d", (trajectory(1.0), trajectory(1.0), trajectory(1.0, StopReason.MAX_TOKENS)))
    [masked] = scored_groups([d], truncated_reward=None)
    [failed] = scored_groups([d], truncated_reward=0.0)
    assert not has_signal(masked) and has_signal(failed)


@pytest.mark.parametrize(("stop", "truncated_reward", "expected"), [
    (StopReason.NO_TOOL_CALL, None, Return(1.0 + 0.25 - 0.5, 1.0)),  # outcome 1 plus the turns' 0.25 and -0.5
    (StopReason.NO_TOOL_CALL, 0.0, Return(0.75, 1.0)),  # the rule touches only truncated episodes
    (StopReason.LENGTH, None, Return(0.0, 0.0, usable=False)),  # masked: out of the statistics
    # the rule's outcome; a truncated episode's turns count nothing (none here was cut: its budget ran out between
    # turns, so nothing is charged either)
    (StopReason.MAX_TOKENS, -1.0, Return(-1.0, -1.0, share=0.0)),
    (StopReason.ERROR, 0.0, Return(0.0, 0.0, usable=False)),  # an infrastructure error never counts
])
def test_an_episode_return_by_hand(stop, truncated_reward, expected):
    traj = trajectory(1.0, stop, task_id="x", turns=[0.25, -0.5])
    assert episode_return(traj, truncated_reward) == expected


def test_a_trajectory_never_scored_is_refused_in_one_line():
    with pytest.raises(ValueError, match="trajectory of task 'a0' has no return: its group was never scored"):
        group_advantages([TrajectoryGroup("a", (trajectory(1.0, task_id="a0"), trajectory(0.0, task_id="a1")))])


def test_the_spread_is_what_the_estimator_normalised():
    """`spread` (logged as reward_std): over the groups that entered the batch, the mean sample std of their
    returns. a: returns (1, 0) -> std sqrt(0.5); b: flat -> dropped, not averaged; c: one usable -> dropped."""
    assert group_advantages(_groups()).spread == pytest.approx(math.sqrt(0.5), abs=1e-12)
    # with a3 kept at 0.0: (1, 0, 0): mean 1/3, squares 4/9 + 1/9 + 1/9 = 2/3, sample var 1/3
    assert group_advantages(_groups(truncated_reward=0.0)).spread == pytest.approx(math.sqrt(1 / 3), abs=1e-12)
