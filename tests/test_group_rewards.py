"""Group-level rewards: the hook after a task's G episodes, how its rewards join the episodes', and failures."""

from __future__ import annotations

import asyncio

import pytest
from helpers import trajectory

from agent_rl.core.mixture import load_mixture
from agent_rl.core.registry import load_env
from agent_rl.core.types import (
    EPISODE_REWARD,
    Message,
    Reward,
    StopReason,
)
from agent_rl.envs.calculator import calculator
from agent_rl.envs.dataset import RubricEnv
from agent_rl.rewards.group import combine_group_rewards, conversation, rubric_group_reward
from agent_rl.rewards.rubric import RewardTerm, Rubric
from agent_rl.rollout.engine import rollout_groups
from agent_rl.rollout.runner import EpisodeLimits, score_group


async def test_a_group_reward_is_added_to_each_finished_trajectory():
    seen = []

    def hook(task, trajectories):
        seen.append((task["id"], [t.reward for t in trajectories]))
        return [Reward(0.5, {"bonus": 1.0}), 0.25]

    group = [trajectory(1.0, reward_parts={"correct": 1.0}), trajectory(0.0, StopReason.ERROR), trajectory(0.0)]
    out = await score_group(hook, {"id": "q"}, group, timeout_s=5)
    assert seen == [("q", [1.0, 0.0])]  # the infra error is not shown to the hook
    assert [t.reward for t in out] == [1.5, 0.0, 0.25]
    assert out[0].reward_parts == {EPISODE_REWARD: 1.0, "correct": 1.0, "bonus": 1.0}
    assert out[1] is group[1]
    assert out[2].reward_parts == {EPISODE_REWARD: 0.0}
    assert await score_group(lambda task, ts: None, {"id": "q"}, group, 5) == group  # None: nothing added


@pytest.mark.parametrize("hook, why", [
    (lambda task, ts: 1 / 0, "group reward failed: ZeroDivisionError: division by zero"),
    (lambda task, ts: [1.0], "group reward failed: ValueError: 1 rewards for 2 trajectories"),
    (lambda task, ts: ["high", "low"], "group reward failed: ValueError: could not convert string to float: 'high'"),
])
async def test_a_group_reward_that_fails_takes_its_group_out_with_the_reason(hook, why):
    out = await score_group(hook, {"id": "q"}, [trajectory(1.0), trajectory(0.0)], timeout_s=5)
    assert [(t.stop_reason, t.error) for t in out] == [(StopReason.ERROR, why)] * 2


async def test_a_group_reward_has_a_deadline():
    async def slow(task, ts):
        await asyncio.sleep(30)

    out = await asyncio.wait_for(score_group(slow, {"id": "q"}, [trajectory(1.0), trajectory(0.0)], timeout_s=0.2), 5)
    assert {t.error for t in out} == {"group reward failed: TimeoutError"}


GROUP_ENV = '''
from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import Reward
from agent_rl.envs.toy import load_tasks, make_env


async def group_reward(task, trajectories):
    """The shortest answer of the group gets a bonus."""
    best = min(len(t.messages[-1].content) for t in trajectories)
    return [Reward(float(len(t.messages[-1].content) == best), {"shortest": 1.0}) for t in trajectories]


ENV = EnvSpec("group_env_here", make_env, load_tasks, group_reward=group_reward)
'''


async def test_an_environment_modules_group_reward_runs_after_its_groups(tmp_path, scripted, renderer):
    (tmp_path / "group_env_here.py").write_text(GROUP_ENV)
    spec = load_env(str(tmp_path / "group_env_here.py"))
    replies = iter(["Short.", "A longer reply.", "Much longer reply here.", "Tiny."])
    groups = await rollout_groups(spec.load_tasks(2), spec.make_env, scripted(lambda p: next(replies)), renderer,
                                  EpisodeLimits(max_turns=1), 2, group_reward=spec.group_reward)
    rewards = [[round(t.reward - t.reward_parts[EPISODE_REWARD], 6) for t in g.trajectories] for g in groups]
    assert rewards == [[1.0, 0.0], [0.0, 1.0]]
    # in a mixture only that environment's groups get it
    mix = load_mixture([("toy", 1.0), (str(tmp_path / "group_env_here.py"), 1.0)])
    replies = iter(["Short.", "A longer reply.", "Much longer reply here.", "Tiny."])
    groups = await rollout_groups(mix.load_tasks(2), mix.make_env, scripted(lambda p: next(replies)), renderer,
                                  EpisodeLimits(max_turns=1), 2, group_reward=mix.group_reward)
    assert ["shortest" in t.reward_parts for g in groups for t in g.trajectories] == [False, False, True, True]


def test_conversation_splits_at_the_first_sampled_turn():
    messages = (Message("system", "s"), Message("user", "2+2?"), Message("assistant", "4"),  # a few-shot example
                Message("user", "3+3?"), Message("assistant", "<tool_call>..."), Message("tool", "6", name="calc"),
                Message("assistant", "6"))
    t = trajectory(turns=[0.0, 0.0], messages=messages)
    prompt, completion = conversation(t)
    assert [m["content"] for m in prompt] == ["s", "2+2?", "4", "3+3?"]
    assert completion == [{"role": "assistant", "content": "<tool_call>..."},
                          {"role": "tool", "content": "6", "name": "calc"}, {"role": "assistant", "content": "6"}]


def exact(completions, answer, **kwargs):
    return [float(c[-1]["content"].endswith(str(a))) for c, a in zip(completions, answer)]


def shortest(completions, **kwargs):  # a group term: sees the G completions of one task at once
    lengths = [len(c[-1]["content"]) for c in completions]
    return [float(n == min(lengths)) for n in lengths]


async def test_rubric_group_terms_score_the_group_with_the_rubric_weights(scripted, renderer):
    rubric = Rubric([(exact, 1.0), RewardTerm(shortest, 0.5, group=True)])
    tasks = [{"id": "q", "question": "What is 6 * 7?", "answer": "42"}]
    replies = iter(["It is 42", "The answer is 42", "I think 41"])
    groups = await rollout_groups(tasks, lambda task: RubricEnv(task, [calculator], rubric),
                                  scripted(lambda p: next(replies)), renderer, EpisodeLimits(max_turns=1), 3,
                                  group_reward=rubric_group_reward(rubric))
    ts = groups[0].trajectories
    assert [t.reward for t in ts] == [1.5, 1.0, 0.0]  # exact + 0.5 x shortest
    assert ts[0].reward_parts == {EPISODE_REWARD: 1.0, "exact": 1.0, "shortest": 1.0}
    assert ts[2].reward_parts == {EPISODE_REWARD: 0.0, "exact": 0.0, "shortest": 0.0}
    with pytest.raises(ValueError, match="no group terms"):
        rubric_group_reward(Rubric([(exact, 1.0)]))


async def test_a_group_term_returning_the_wrong_count_fails_the_group_with_its_name(scripted, renderer):
    rubric = Rubric([RewardTerm(lambda completions, **kw: [1.0], 1.0, "judge_one", group=True)])
    groups = await rollout_groups([{"id": "q", "question": "Hi?"}], lambda task: RubricEnv(task, [], rubric),
                                  scripted(lambda p: "Hello."), renderer, EpisodeLimits(max_turns=1), 2,
                                  group_reward=rubric_group_reward(rubric))
    assert {t.error for t in groups[0].trajectories} == {
        "group reward failed: RewardError: reward function 'judge_one' returned 1 values for 2 completions"}


async def test_combined_group_rewards_add_up():
    def a(task, ts):
        return [1.0 for _ in ts]

    async def b(task, ts):
        return [Reward(0.5, {"b": 2.0}) for _ in ts]

    both = combine_group_rewards(None, a, b, lambda task, ts: None)
    out = await both({"id": "q"}, [trajectory(0.0), trajectory(0.0)])
    assert out == [Reward(1.5, {"b": 2.0})] * 2
    assert combine_group_rewards(None, a) is a and combine_group_rewards(None) is None
