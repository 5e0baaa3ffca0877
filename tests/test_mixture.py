"""Several environments in one run: the config, the schedule, tagged tasks, dispatch, per-environment figures."""

from __future__ import annotations

import pytest
from helpers import trajectory

from agent_rl.config.file import load_config
from agent_rl.core.config import ConfigError
from agent_rl.core.mixture import Mixture, load_mixture, schedule
from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import EPISODE_REWARD, StopReason, ToolCallRecord, TrajectoryGroup
from agent_rl.evaluation.evaluate import eval_report
from agent_rl.rollout.engine import rollout_groups
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.runs.metrics import env_metrics, rollout_metrics
from agent_rl.session import env_of
from agent_rl.trainer import TaskStream


# -- config ------------------------------------------------------------------------------------------
def test_envs_as_a_list_or_a_mapping_replace_the_single_env():
    as_list = load_config(None, ["rollout.envs=[{name: calculator, weight: 3}, {name: toy}]"])
    as_map = load_config(None, ["rollout.envs={calculator: 3, toy: 1}"])
    assert as_list.rollout.env is None and as_list.rollout.mixture == (("calculator", 3.0), ("toy", 1.0))
    assert as_map.rollout == as_list.rollout
    assert load_config(None, []).rollout.mixture == (("calculator", 1.0),)  # one env: weight 1


def test_each_environment_of_a_mixture_takes_its_own_env_args():
    cfg = load_config(None, ["rollout.envs=[{name: gui, weight: 1, args: {levels: [2]}}, {name: toy}]"])
    tasks = env_of(cfg).load_tasks(4, seed=0)
    assert [t["level"] for t in tasks if t["env"] == "gui"] == [2, 2]
    with pytest.raises(ConfigError, match=r"env_args: for rollout.env alone; give each of rollout.envs its own args"):
        load_config(None, ["rollout.envs={gui: 1, toy: 1}", "rollout.env_args={levels: [2]}"])
    with pytest.raises(ValueError, match=r"^rollout.env_args: 'toy' load_tasks takes no argument 'levels'"):
        env_of(load_config(None, ["rollout.envs=[{name: gui}, {name: toy, args: {levels: [1]}}]"]))


def test_a_mixture_round_trips_through_the_saved_config(tmp_path):
    from agent_rl.config.file import dump_config

    cfg = load_config(None, ["rollout.envs={calculator: 3, toy: 1}"])
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(str(path)) == cfg


@pytest.mark.parametrize("overrides, message", [
    (["rollout.envs={toy: 1}", "rollout.env=toy"],
     "config error: rollout.envs: give one environment (env) or a weighted list (envs), not both; "
     "set rollout.env=null to use rollout.envs (got env: toy)"),
    (["rollout.env=null"],
     "config error: rollout.env: name an environment, or list several in rollout.envs (got null)"),
    (["rollout.envs={toy: 0}"], "config error: rollout.envs.0.weight: Input should be greater than 0 (got 0)"),
    (["rollout.envs=[{name: toy}, {name: toy, weight: 2}]"],
     "config error: rollout.envs: each environment once; give it a larger weight instead (got toy twice)"),
    (["rollout.envs=[{name: toy, weigth: 2}]"], "config error: rollout.envs.0.weigth: unknown field"),
])
def test_mixture_config_mistakes_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert str(info.value) == message


def test_a_bad_name_in_the_mixture_fails_when_the_session_opens():
    cfg = load_config(None, ["rollout.envs={toy: 1, no_such_env_here: 1}"])
    with pytest.raises(ValueError, match="unknown environment 'no_such_env_here'"):
        env_of(cfg)
    with pytest.raises(ValueError, match="names toy twice"):
        load_mixture([("toy", 1.0), ("envs/toy.py", 2.0)])


# -- the schedule and the tasks ----------------------------------------------------------------------
def test_schedule_by_hand():
    assert schedule([1, 1], 6) == [0, 1, 0, 1, 0, 1]
    assert schedule([3, 1], 8) == [0, 0, 1, 0, 0, 0, 1, 0]  # smooth: the 1 is not bunched at the end
    assert schedule([2, 1, 1], 4) == [0, 1, 2, 0]


@pytest.mark.parametrize("weights", [[1, 1], [3, 1], [0.2, 0.5, 0.3], [5, 1, 1, 2]])
def test_every_prefix_of_the_schedule_is_in_proportion_to_within_one_task(weights):
    slots = schedule(weights, 200)
    for n in range(1, 201):
        for i, w in enumerate(weights):
            assert abs(slots[:n].count(i) - n * w / sum(weights)) < 1.0
    assert schedule(weights, 200) == slots  # deterministic


def spec(name: str, rows: list[dict], **kw) -> EnvSpec:
    return EnvSpec(name, lambda task: ("env of", name, task), lambda n, seed=0, split="train": rows[:n], **kw)


def test_tasks_come_in_slot_order_tagged_and_each_env_plays_its_own_untagged():
    a = [{"id": f"a{i}"} for i in range(5)]
    b = [{"id": f"b{i}", "x": i} for i in range(5)]
    mix = Mixture((spec("a", a), spec("b", b)), (3.0, 1.0), ("a", "b")).as_spec()
    tasks = mix.load_tasks(8, seed=0)
    assert [t["id"] for t in tasks] == ["a0", "a1", "b0", "a2", "a3", "a4", "b1", "a0"]  # a has 5: it wraps
    assert [t["env"] for t in tasks] == ["a", "a", "b", "a", "a", "a", "b", "a"]
    assert mix.make_env(tasks[2]) == ("env of", "b", {"id": "b0", "x": 0})  # the tag is gone
    assert "env" not in b[0]  # the environment's own rows are untouched
    assert mix.solve is None and mix.group_reward is None  # neither env has one
    with pytest.raises(ValueError, match=r"task 'z' names no environment of the mixture a x3 \+ b x1"):
        mix.make_env({"id": "z", "env": "c"})


def test_rows_with_an_env_column_cannot_be_mixed():
    mix = Mixture((spec("a", [{"id": "a", "env": "mine"}]), spec("b", [{"id": "b"}])), (1.0, 1.0), ("a", "b"))
    with pytest.raises(ValueError, match="environment 'a': its tasks have an 'env' column"):
        mix.load_tasks(2)


def test_task_stream_positions_count_each_environments_tasks():
    stream = TaskStream([{"id": i, "env": e} for i, e in enumerate("aabab")])
    assert stream.positions(0) == {"data_position": 0.0, "data_position/a": 0.0, "data_position/b": 0.0}
    assert stream.positions(4) == {"data_position": 4.0, "data_position/a": 3.0, "data_position/b": 1.0}
    assert stream.positions(7) == {"data_position": 7.0, "data_position/a": 5.0, "data_position/b": 2.0}  # wrapped
    assert TaskStream([{"id": 1}]).positions(3) == {"data_position": 3.0}  # one environment: as before


# -- playing a mixture ---------------------------------------------------------------------------------
async def test_a_mixture_plays_each_task_in_its_own_environment(scripted, renderer):
    mix = load_mixture([("toy", 1.0), ("calculator", 1.0)])
    tasks = mix.load_tasks(4, seed=0)

    def script(prompt: str) -> str:
        return "The answer is 27." if "What is" in prompt else "Cats."

    groups = await rollout_groups(tasks, mix.make_env, scripted(script), renderer, EpisodeLimits(max_turns=1), 2)
    envs = [[t.env for t in g.trajectories] for g in groups]
    assert envs == [["toy"] * 2, ["calculator"] * 2, ["toy"] * 2, ["calculator"] * 2]
    toy, calc = groups[0].trajectories[0], groups[1].trajectories[0]
    assert toy.reward == pytest.approx(1 - len("Cats.") / 200) and "chars" in toy.reward_parts
    assert calc.messages[-2].content.endswith(tasks[1]["question"]) and calc.reward == float(tasks[1]["answer"] == 27)
    metrics = rollout_metrics([t for g in groups for t in g.trajectories], success_threshold=1.0)
    assert metrics["env/toy/rollouts"] == 4 and metrics["env/calculator/rollouts"] == 4
    assert metrics["env/toy/reward_mean"] == pytest.approx(1 - 5 / 200)


CALC = ToolCallRecord("calc", True, None, 0.1, 0)  # one call that went well


def test_env_metrics_by_hand():
    ts = [trajectory(1.0, env="a", calls=[CALC]), trajectory(0.0, env="a"), trajectory(0.5, StopReason.ERROR, env="a"),
          trajectory(1.4, env="b", reward_parts={EPISODE_REWARD: 0.9}), trajectory(1.0, env="b", calls=[CALC, CALC])]
    m = env_metrics(ts, success_threshold=1.0)
    assert m["env/a/rollouts"] == 3 and m["env/a/infra_error_rate"] == pytest.approx(1 / 3)
    assert m["env/a/reward_mean"] == 0.5 and m["env/a/accuracy"] == 0.5 and m["env/a/tool_use_rate"] == 0.5
    # accuracy is the episode's own reward: 0.9 before a group reward of 0.5 is not solved
    assert m["env/b/reward_mean"] == pytest.approx(1.2) and m["env/b/accuracy"] == 0.5
    assert m["env/b/tool_calls_per_traj"] == 1.0
    assert env_metrics([trajectory(1.0)]) == {}  # one environment: no per-environment figures
    assert "env/a/rollouts" not in rollout_metrics(ts)  # only with a threshold (the trainer passes eval's)


def test_eval_report_per_environment_by_hand():
    groups = [TrajectoryGroup("a1", (trajectory(1.0, env="a"), trajectory(0.0, env="a"))),
              TrajectoryGroup("a2", (trajectory(0.0, env="a"), trajectory(0.0, env="a"))),
              TrajectoryGroup("b1", (trajectory(1.0, env="b", calls=[CALC]), trajectory(1.0, env="b")))]
    report = eval_report(groups)
    assert report["accuracy"] == pytest.approx(3 / 6)
    assert report["env/a/tasks"] == 2 and report["env/a/accuracy"] == 0.25 and report["env/a/pass@2"] == 0.5
    assert report["env/b/accuracy"] == 1.0 and report["env/b/pass@1"] == 1.0
    assert report["env/b/tool_use_rate"] == 0.5 and report["env/b/accuracy_with_tools"] == 1.0
    assert not any(k.startswith("env/") for k in eval_report(groups[:0]))


async def test_demos_of_a_mixture_come_from_each_environments_solver(renderer):
    from agent_rl.demos import make_demos

    mix = load_mixture([("calculator", 1.0), ("math", 1.0)])
    demos, stats = await make_demos(mix, renderer, 4, seed=0)
    assert stats["demos"] == 4 and [t.env for t in demos] == ["calculator", "math", "calculator", "math"]
    assert [t.reward for t in demos] == [1.0] * 4  # each solved by its own environment's solver
