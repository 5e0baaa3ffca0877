"""verifiers environments as agent-rl episodes (envs.verifiers_env), on the real `verifiers` package.

Environments: one written here with verifiers' public API (tests/vf_add_taskset.py: a taskset, a toolset,
rewards and a metric), played against the ids tests/test_rollout_tokens.py writes out by hand; a package as
verifiers' own `vf-init --add-tool` scaffolds one; examples/vf_calculator.py with its scripted solver; and
verifiers' shipped `openenv` taskset (its `Env.run()` steps an OpenEnv server as the user), which fails in one
line against openenv-core 0.3. The policy is a scripted sampler.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

pytest.importorskip("verifiers", reason="the verifiers adapter needs pip install 'agent-rl[verifiers]'")

from helpers import AddEnv, play_episode, script_of
from test_rollout_tokens import (
    ANSWER,
    CALL_1,
    CALL_2,
    GEN,
    SAMPLED_1,
    SAMPLED_2,
    SAMPLED_3,
    SYSTEM,
    TOOL_5,
    TOOL_9,
    USER,
)

from agent_rl.core.registry import load_env
from agent_rl.core.types import StopReason
from agent_rl.envs import verifiers_env
from agent_rl.rollout.runner import EpisodeLimits, run_episode

ADD = "vf_add_taskset"


async def vf_episode(row, sampler, renderer, **limits):
    """The episode of the verifiers task `row`."""
    return await play_episode(verifiers_env.make_env(row), sampler, renderer, EpisodeLimits(**limits), row["id"])


def test_taskset_rows_train_and_eval_disjoint_and_deterministic():
    train = verifiers_env.load_tasks(8, taskset=ADD)
    assert sorted(r["id"] for r in train) == [f"add-{i}" for i in (0, 1, 2, 3, 5, 6, 7, 8)]  # idx 4, 9: eval
    assert sorted(r["id"] for r in verifiers_env.load_tasks(2, split="eval", taskset=ADD)) == ["add-4", "add-9"]
    assert verifiers_env.load_tasks(8, taskset=ADD) == train
    assert [r["id"] for r in verifiers_env.load_tasks(8, seed=1, taskset=ADD)] != [r["id"] for r in train]
    assert (train[0]["data"]["prompt"], train[0]["data"]["answer"]) == ("2+3+4?", "9")
    # args are the taskset's config fields: 5 tasks leave one eval task, cycled
    assert [r["id"] for r in verifiers_env.load_tasks(3, split="eval", taskset=ADD, args={"num_tasks": 5})] == \
        ["add-4"] * 3


async def test_episode_is_token_exact_and_scored_by_the_task(scripted, renderer):
    row = verifiers_env.load_tasks(1, taskset=ADD)[0]
    async with verifiers_env.make_env(row) as env:
        traj = await run_episode(env, scripted(script_of([CALL_1, CALL_2, ANSWER]), logprob=-0.25), renderer,
                                 EpisodeLimits(), row["id"])
    assert traj.error is None and traj.stop_reason is StopReason.NO_TOOL_CALL
    # the verifiers trace the task scored: the conversation, each tool result answering its call's id
    [trace] = env.bridge.traces
    assert [m.role for m in trace.messages] == ["system", "user", "assistant", "tool", "assistant", "tool",
                                                "assistant"]
    calls = [c.id for m in trace.messages if m.role == "assistant" for c in m.tool_calls or []]
    assert calls == [m.tool_call_id for m in trace.messages if m.role == "tool"] == ["call_2_0", "call_4_0"]
    assert trace.num_turns == 3 and trace.last_reply == "It is 9."
    prompt = SYSTEM + USER + GEN
    assert list(traj.token_ids) == prompt + SAMPLED_1 + TOOL_5 + GEN + SAMPLED_2 + TOOL_9 + GEN + SAMPLED_3
    mask = ([0] * len(prompt) + [1] * len(SAMPLED_1) + [0] * len(TOOL_5 + GEN) + [1] * len(SAMPLED_2)
            + [0] * len(TOOL_9 + GEN) + [1] * len(SAMPLED_3))
    assert list(traj.loss_mask) == mask
    assert list(traj.logprobs) == [-0.25 if m else 0.0 for m in mask]
    # the task's own scoring: correct (weight 1), add_calls (weight 0: a part, not in the value), turns (a metric)
    assert (traj.reward, traj.reward_parts) == (1.0, {"correct": 1.0, "add_calls": 2.0, "turns": 3.0})
    assert [(c.name, c.ok) for c in traj.tool_calls] == [("add", True), ("add", True)]
    assert [m.content for m in traj.messages if m.role == "tool"] == ["5", "9"]
    # the same episode of the native env: the same tokens, turn for turn
    native = await play_episode(AddEnv(), scripted(script_of([CALL_1, CALL_2, ANSWER]), logprob=-0.25), renderer,
                                task_id=row["id"])
    for field in ("token_ids", "loss_mask", "logprobs", "prompt_len", "turns", "messages", "stop_reason"):
        assert getattr(traj, field) == getattr(native, field), field


async def test_wrong_answer_and_malformed_call(scripted, renderer):
    row = verifiers_env.load_tasks(1, taskset=ADD)[0]
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": </tool_call>'
    traj = await vf_episode(row, scripted(script_of([bad, "It is 8."])), renderer)
    assert traj.stop_reason is StopReason.NO_TOOL_CALL and len(traj.turns) == 2
    [tool] = [m for m in traj.messages if m.role == "tool"]
    assert tool.content.startswith("Error: ") and not traj.tool_calls[0].ok
    assert (traj.reward, traj.reward_parts) == (0.0, {"correct": 0.0, "add_calls": 0.0, "turns": 2.0})


async def test_turn_limit_ends_the_episode_and_it_is_still_scored(scripted, renderer):
    row = verifiers_env.load_tasks(1, taskset=ADD)[0]
    traj = await vf_episode(row, scripted(script_of([CALL_1, CALL_2])), renderer, max_turns=2)
    assert traj.stop_reason is StopReason.MAX_TURNS and traj.error is None
    assert traj.reward_parts == {"correct": 0.0, "add_calls": 2.0, "turns": 2.0}


async def test_errors_inside_verifiers_are_one_line_episode_errors(scripted, renderer):
    row = verifiers_env.load_tasks(1, taskset=ADD, args={"task": {"fail_reward": True}})[0]
    traj = await vf_episode(row, scripted(script_of([ANSWER])), renderer)
    assert traj.stop_reason is StopReason.ERROR and traj.infra_error
    assert "\n" not in traj.error and "KeyError" in traj.error and "no answer key" in traj.error
    assert traj.error.startswith("VerifiersError: the environment raised TaskError: task AddTask scoring")


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({"taskset": "no_such_taskset"}, "verifiers environment 'no_such_taskset': ModuleNotFoundError: taskset"),
    ({"taskset": ADD, "args": {"num_tasks": "many"}}, "taskset.num_tasks: Input should be a valid integer"),
    ({"taskset": ""}, "rollout.env_args.taskset: name the verifiers taskset"),
    ({"taskset": ADD, "split": "test"}, "split must be 'train' or 'eval'"),
])
def test_bad_names_and_args_are_one_line(kwargs, expected):
    with pytest.raises(ValueError) as e:
        verifiers_env.load_tasks(2, **kwargs)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_env_args_reach_load_tasks_through_the_registry():
    spec = load_env("agent_rl.envs.verifiers_env").with_task_args({"taskset": ADD, "args": {"num_tasks": 5}})
    assert [r["id"] for r in spec.load_tasks(2, split="eval")] == ["add-4", "add-4"]


def test_missing_package_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "verifiers" or m.startswith("verifiers.")]:
        monkeypatch.setitem(sys.modules, name, None)
    for name in ("agent_rl.envs.verifiers_env", "agent_rl.envs.verifiers_seat"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ValueError) as e:
        load_env("agent_rl.envs.verifiers_env")
    assert "pip install 'agent-rl[verifiers]'" in str(e.value) and "\n" not in str(e.value)


# -- environments verifiers ships or documents ------------------------------------------------------------
async def test_a_package_scaffolded_by_vf_init(tmp_path, monkeypatch, scripted, renderer):
    """`vf-init echo-env --add-tool` (verifiers' documented way to start an environment: a package with a
    taskset, a task with a `@vf.reward`, a `vf.Toolset` server) with its two stubs filled in, as its README
    asks: `load` and the reward. Its tool is advertised with the toolset's prefix, as verifiers names it."""
    from verifiers.v1.cli.init import scaffold
    from verifiers.v1.configs.cli.init import InitConfig

    env_dir = scaffold(InitConfig(name="echo-env", path=str(tmp_path), add_tool=True))
    taskset = env_dir / "echo_env" / "taskset.py"
    source = taskset.read_text()
    load = source[source.index("        raise NotImplementedError(\n            \"Return"):]
    source = source.replace(load, "        return [EchoEnvTask(EchoEnvData(prompt=f'Echo the word hello ({i}).'), "
                                  "self.config.task) for i in range(self.config.num_tasks)]\n")
    source = source.replace('raise NotImplementedError("Score the rollout and return a float (e.g. in [0, 1]).")',
                            'return float(trace.last_reply == "hello")')
    taskset.write_text(source)
    monkeypatch.syspath_prepend(str(env_dir))
    row = verifiers_env.load_tasks(1, taskset="echo-env")[0]
    call = '<tool_call>\n{"name": "echo_env_echo", "arguments": {"text": "hello"}}\n</tool_call>'
    sampler = scripted(script_of([call, "hello"]))
    async with verifiers_env.make_env(row) as env:
        assert [t["function"]["name"] for t in env.tool_schemas] == ["echo_env_echo"]
        traj = await run_episode(env, sampler, renderer, EpisodeLimits(), row["id"])
    assert traj.error is None and [m.content for m in traj.messages if m.role == "tool"] == ["hello"]
    assert (traj.reward, traj.reward_parts) == (1.0, {"reward": 1.0})
    assert all(list(traj.token_ids[:len(p)]) == p for p in sampler.calls)  # each prompt extends the last


async def test_verifiers_shipped_openenv_taskset_fails_in_one_line(scripted, renderer):
    """verifiers' own `openenv` taskset (an `Env.run()` that steps an OpenEnv server as the user) reads
    `GenericEnvClient._base_url`, which only the `openenv` >= 0.4.1 distribution has; that one cannot be
    installed beside verifiers 0.4 (its fastmcp 3 needs mcp < 2, verifiers pins mcp 2.0.0). With openenv-core
    0.3 its run() raises, and the episode is one line of error, not a traceback."""
    pytest.importorskip("openenv", reason="the OpenEnv adapter needs pip install 'agent-rl[openenv]'")
    from pathlib import Path

    from agent_rl.envs import openenv_env

    url = await openenv_env.local_server(str(Path(__file__).parents[1] / "examples" / "openenv_guess"))
    row = verifiers_env.load_tasks(1, taskset="openenv", args={"base_url": url, "resets": [{"seed": 0}] * 5})[0]
    traj = await vf_episode(row, scripted(script_of(['{"guess": 1}'])), renderer)
    assert traj.stop_reason is StopReason.ERROR and "\n" not in traj.error
    assert traj.error == ("VerifiersError: the environment raised AttributeError: 'GenericEnvClient' object has "
                          "no attribute '_base_url'")


async def test_example_taskset_file_and_its_scripted_solver(scripted, renderer):
    """examples/vf_calculator.py, named by its file: the calculator as a verifiers taskset, solved by the
    `solve` its module defines (what `agent-rl demos` plays); the tool is the one the native env offers."""
    from pathlib import Path

    from agent_rl.envs import calculator

    path = str(Path(__file__).parents[1] / "examples" / "vf_calculator.py")
    [row] = verifiers_env.load_tasks(1, taskset=path, args={"num_tasks": 6})
    assert row["id"] in {f"arith-0-{i}" for i in (0, 1, 2, 3, 5)}
    sampler = scripted(lambda messages: verifiers_env.solve(row, messages), on_messages=True)
    async with verifiers_env.make_env(row) as env:
        assert env.tool_schemas == [calculator.CalculatorEnv({"question": "", "answer": 0}).tools[0].schema]
        traj = await run_episode(env, sampler, renderer, EpisodeLimits(), row["id"])
    assert traj.error is None and (traj.reward, traj.reward_parts) == (1.0, {"correct": 1.0, "tool_calls": 1.0})
    with pytest.raises(ValueError, match="^verifiers taskset 'vf_add_taskset' has no scripted solver: define solve"):
        verifiers_env.solve(verifiers_env.load_tasks(1, taskset=ADD)[0], [])


def test_rollout_cli_env_args_errors_are_one_line(capsys):
    """`agent-rl rollout --env-args` is `rollout.env_args`: a value that is no mapping, or a taskset that
    does not exist, stops the command with one line (exit 2) before any server is needed."""
    from agent_rl.cli import main

    assert main(["rollout", "--env", "agent_rl.envs.verifiers_env", "--env-args", "[1, 2]"]) == 2
    assert capsys.readouterr().err.strip() == \
        "error: config error: rollout.env_args: Input should be a valid dictionary (got [1, 2])"
    assert main(["rollout", "--env", "agent_rl.envs.verifiers_env", "--env-args", "{taskset: nope}",
                 "--server-url", "http://127.0.0.1:9"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: environment 'agent_rl.envs.verifiers_env' could not load tasks: ValueError: "
                           "verifiers environment 'nope': ModuleNotFoundError: taskset 'nope' not found")


async def test_a_tool_server_that_fails_or_hangs_in_setup_is_one_line(monkeypatch, scripted, renderer):
    import vf_add_taskset

    row = verifiers_env.load_tasks(1, taskset=ADD)[0]

    async def broken(self, task):
        raise OSError("port in use")

    monkeypatch.setattr(vf_add_taskset.AddTools, "setup_task", broken)
    with pytest.raises(verifiers_env.VerifiersError) as e:
        async with verifiers_env.make_env(row):
            pass
    assert str(e.value) == "a tool server of 'vf_add_taskset' failed to start: OSError: port in use"

    async def hangs(self, task):
        await asyncio.sleep(60)

    monkeypatch.setattr(vf_add_taskset.AddTools, "setup_task", hangs)
    with pytest.raises(verifiers_env.VerifiersError, match="^a tool server of 'vf_add_taskset' did not set up "
                                                           "within 0.2 s$"):
        async with verifiers_env.VerifiersEnv(row, step_timeout_s=0.2):
            pass


# -- nothing dropped silently: the task's own @vf.stop hooks, content no chat format takes -----------------------
TICK = '<tool_call>\n{"name": "tick", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize("stop_on, replies, turns, ticks", [
    ("ticks", [TICK, TICK, TICK, "Done."], 2, 2),  # a trace hook, before the third model call
    ("give_up", [TICK, "I GIVE UP " + TICK, "Done."], 2, 1),  # a response hook: that reply's call never runs
    ("long_request", [TICK, TICK, TICK, "Done."], 2, 2),  # a request hook: the third request has 6 messages
])
async def test_a_stop_hook_ends_the_episode_where_it_says(scripted, renderer, stop_on, replies, turns, ticks):
    row = verifiers_env.load_tasks(1, taskset="vf_stop_taskset", args={"task": {"stop_on": stop_on}})[0]
    async with verifiers_env.make_env(row) as env:
        traj = await run_episode(env, scripted(script_of(replies)), renderer, EpisodeLimits(), row["id"])
    [trace] = env.bridge.traces
    assert traj.error is None and traj.stop_reason is StopReason.ENV_DONE and len(traj.turns) == turns
    assert trace.stop_condition == {"ticks": "enough_ticks", "give_up": "gave_up", "long_request": "long_request"}[
        stop_on]
    assert traj.reward_parts == {"ticks": float(ticks)} and len(traj.tool_calls) == ticks
    assert trace.num_turns == turns  # the last reply is in the trace the task scored


async def test_an_image_the_policy_cannot_take_ends_the_episode_in_one_line(scripted, renderer):
    from agent_rl.envs.verifiers_seat import UnsupportedContent, user_messages

    row = verifiers_env.load_tasks(1, taskset="vf_stop_taskset", args={"image": True})[0]
    traj = await vf_episode(row, scripted(script_of(["Two squares."])), renderer)
    assert traj.stop_reason is StopReason.ERROR and traj.turns == ()
    assert traj.error == ("VerifiersError: the environment raised UnsupportedContent: a user message holds image_url "
                          "content, and agent-rl's chat formats (every model family's renderer) take text only: the "
                          "episode ends here rather than drop it")
    # a follow-up user message (a simulated user's) with an image: the same error, inside the environment's run()
    with pytest.raises(UnsupportedContent, match="^a user message holds image_url content"):
        user_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}])


def test_an_intercept_hook_is_refused_in_one_line():
    import verifiers.v1 as vf
    import vf_stop_taskset

    class Rewriting(vf_stop_taskset.StopTask):
        @vf.intercept
        def shout(self, response: vf.Response) -> vf.Response | None:
            return None

    with pytest.raises(ValueError, match=r"^verifiers taskset 'x': its @vf.intercept hook 'shout' rewrites the model's "
                                         r"requests or responses, which agent-rl does not do \(the sampled tokens "
                                         r"are the episode\)$"):
        verifiers_env._stops(Rewriting(vf.TaskData(id="t", prompt="?"), vf_stop_taskset.StopTaskConfig()), "x")
