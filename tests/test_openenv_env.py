"""OpenEnv environments as agent-rl episodes (envs.openenv_env), on the real `openenv-core` package.

The environment is examples/openenv_guess, a guessing game built with openenv-core's own server classes
(`Environment`, `Action`, `Observation`, `create_app`), served as OpenEnv serves a folder (uvicorn on the
app its openenv.yaml names) and reached by URL; the policy is a scripted sampler. The server is killed in
the middle of an episode: that episode is one line of error, and the next ones go on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("openenv", reason="the OpenEnv adapter needs pip install 'agent-rl[openenv]'")

from agent_rl.core.registry import load_env
from agent_rl.core.types import StopReason
from agent_rl.envs import openenv_env
from agent_rl.rollout.engine import rollout_groups
from agent_rl.rollout.runner import EpisodeLimits, run_episode

GUESS = str(Path(__file__).parents[1] / "examples" / "openenv_guess")


def call(guess) -> str:
    return f'<tool_call>\n{{"name": "step", "arguments": {{"guess": {guess}}}}}\n</tool_call>'


def hidden(row) -> int:
    return row["reset"]["seed"] % 9 + 1  # what the game hides for this seed (examples/openenv_guess)


def test_rows_one_reset_each_seeds_disjoint_between_splits():
    train, ev = openenv_env.load_tasks(3, path=GUESS), openenv_env.load_tasks(3, split="eval", path=GUESS)
    assert [r["reset"] for r in train] == [{"seed": 0}, {"seed": 2}, {"seed": 4}]
    assert [r["reset"] for r in ev] == [{"seed": 1}, {"seed": 3}, {"seed": 5}]
    assert [r["reset"]["seed"] for r in openenv_env.load_tasks(2, seed=1, path=GUESS)] == [1_000_000, 1_000_002]
    assert train[0]["path"] == str(Path(GUESS).resolve()) and "url" not in train[0]
    assert openenv_env.load_tasks(1, url="http://127.0.0.1:9/")[0]["url"] == "http://127.0.0.1:9"


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({}, "give the OpenEnv environment as path (a folder to serve) or url"),
    ({"path": GUESS, "url": "http://x"}, "give the OpenEnv environment as path"),
    ({"path": "/nonexistent"}, "'/nonexistent' is not an OpenEnv environment folder"),
])
def test_bad_env_args_are_one_line(kwargs, expected):
    with pytest.raises(ValueError) as e:
        openenv_env.load_tasks(1, **kwargs)
    assert expected in str(e.value) and "\n" not in str(e.value)


async def test_episode_tokens_tools_and_rewards(scripted, renderer):
    row = openenv_env.load_tasks(1, path=GUESS, reset={"episode_id": "e1"})[0]
    answer = hidden(row)
    wrong = answer % 9 + 1
    sampler = scripted(lambda text: [call(wrong), call('"x"'), call(answer), "Done."][text.count("<tool_response>")],
                       logprob=-0.5)
    async with openenv_env.make_env(row) as env:
        [schema] = env.tool_schemas
        assert schema["function"]["name"] == "step" and schema["function"]["description"] == "Guess the hidden number."
        assert schema["function"]["parameters"]["required"] == ["guess"]
        traj = await run_episode(env, sampler, renderer, EpisodeLimits(max_turns=6), row["id"])
    assert traj.error is None and traj.stop_reason is StopReason.ENV_DONE and len(traj.turns) == 3
    tools = [m.content for m in traj.messages if m.role == "tool"]
    hint = "higher" if wrong < answer else "lower"
    assert tools == [f'{{"message": "{hint}", "guesses_left": 2}}',
                     "Error: Invalid message (code: VALIDATION_ERROR)"]  # the server refused it: the model reads why
    # (the observation of the winning step ends the episode: the runner appends nothing after `done`)
    assert [(c.name, c.ok) for c in traj.tool_calls] == [("step", True), ("step", False), ("step", True)]
    assert (traj.reward, traj.reward_parts) == (1.0, {"openenv_reward": 1.0, "steps": 2.0, "done": 1.0})
    assert traj.messages[1].content == '{"message": "Guess the hidden number from 1 to 9. You have 3 guesses.", ' \
                                       '"guesses_left": 3}'
    # token truth, as for a native env: each prompt extends the last, the masked ids are the sampled replies
    assert all(list(traj.token_ids[:len(p)]) == p for p in sampler.calls)
    replies = [renderer.encode_reply(r) + renderer.stop_token_ids[:1] for r in (call(wrong), call('"x"'), call(answer))]
    assert [i for i, m in zip(traj.token_ids, traj.loss_mask) if m] == [i for r in replies for i in r]
    assert [lp for lp, m in zip(traj.logprobs, traj.loss_mask)] == [-0.5 if m else 0.0 for m in traj.loss_mask]
    assert list(traj.token_ids[:traj.prompt_len]) == renderer.render(list(traj.messages[:2]), [schema])


async def test_by_url_and_a_reply_without_a_call_ends_it(scripted, renderer):
    url = await openenv_env.local_server(GUESS)
    row = openenv_env.load_tasks(1, url=url)[0]
    async with openenv_env.make_env(row) as env:
        traj = await run_episode(env, scripted(lambda text: "I give up."), renderer, EpisodeLimits(), row["id"])
    assert traj.stop_reason is StopReason.NO_TOOL_CALL and traj.error is None
    assert traj.reward_parts == {"openenv_reward": 0.0, "steps": 0.0, "done": 0.0}


async def test_server_dying_mid_episode_is_one_line_and_the_run_goes_on(scripted, renderer):
    rows = openenv_env.load_tasks(3, path=GUESS)
    url = await openenv_env.local_server(GUESS)
    killed = []

    def script(text: str) -> str:  # two wrong guesses (9 is no seed's number here), then "Done."
        if "<tool_response>" in text and not killed:  # the first episode's second turn: the server dies
            killed.append(openenv_env.SERVERS[str(Path(GUESS).resolve())])
            killed[0].stop()
        return call(9) if text.count("<tool_response>") < 2 else "Done."

    groups = await rollout_groups(rows, openenv_env.make_env, scripted(script), renderer,
                                  EpisodeLimits(env_timeout_s=60), group_size=1, max_concurrent=1)
    trajs = [g.trajectories[0] for g in groups]
    assert [t.stop_reason for t in trajs] == [StopReason.ERROR, StopReason.NO_TOOL_CALL, StopReason.NO_TOOL_CALL]
    assert "\n" not in trajs[0].error and trajs[0].error.startswith("OpenEnvError: OpenEnv server ")
    assert "failed on step" in trajs[0].error
    assert killed[0].url == url and openenv_env.SERVERS[str(Path(GUESS).resolve())] is not killed[0]  # restarted


async def test_unreachable_url_is_one_line(scripted, renderer):
    row = openenv_env.load_tasks(1, url="http://127.0.0.1:9")[0]
    [group] = await rollout_groups([row], openenv_env.make_env, scripted(lambda text: "x"), renderer,
                                   EpisodeLimits(), group_size=1)
    [traj] = group.trajectories
    assert traj.stop_reason is StopReason.ERROR and "\n" not in traj.error
    assert traj.error.startswith("environment could not start: ConnectionError: Failed to connect to ws://127.0.0.1:9/ws")


def test_missing_package_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "openenv" or m.startswith("openenv.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "agent_rl.envs.openenv_env", raising=False)
    with pytest.raises(ValueError) as e:
        load_env("agent_rl.envs.openenv_env")
    assert "pip install 'agent-rl[openenv]'" in str(e.value) and "\n" not in str(e.value)


async def test_the_folders_scripted_solver(scripted, renderer):
    """examples/openenv_guess/solver.py (binary search on the answers) is what `agent-rl demos` plays; a
    server reached by URL has no folder, hence no solver: one line."""
    [row] = openenv_env.load_tasks(1, path=GUESS)  # seed 0 hides 1: 5, 2, 1
    sampler = scripted(lambda messages: openenv_env.solve(row, messages), on_messages=True)
    async with openenv_env.make_env(row) as env:
        traj = await run_episode(env, sampler, renderer, EpisodeLimits(max_turns=4), row["id"])
    assert [c.arguments for m in traj.messages for c in m.tool_calls] == [{"guess": 5}, {"guess": 2}, {"guess": 1}]
    assert (traj.reward, traj.stop_reason) == (1.0, StopReason.ENV_DONE)
    with pytest.raises(ValueError, match="^OpenEnv environment 'http://127.0.0.1:9' has no scripted solver"):
        openenv_env.solve(openenv_env.load_tasks(1, url="http://127.0.0.1:9")[0], [])


async def test_an_mcp_environment_offers_its_listed_tools(scripted, renderer):
    """tests/openenv_mcp: an `MCPEnvironment` over a FastMCP server. Its tools are the model's tools, each
    call a `call_tool` step whose text result is the tool message; a tool that raises is the tool's error."""
    [row] = openenv_env.load_tasks(1, path=str(Path(__file__).parent / "openenv_mcp"))
    replies = ['<tool_call>\n{"name": "divide", "arguments": {"a": 1, "b": 0}}\n</tool_call>',
               '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>', "42"]
    sampler = scripted(lambda text: replies[text.count("<tool_response>")])
    async with openenv_env.make_env(row) as env:
        assert [t["function"]["name"] for t in env.tool_schemas] == ["add", "divide"]
        assert env.tool_schemas[0]["function"]["parameters"]["required"] == ["a", "b"]
        traj = await run_episode(env, sampler, renderer, EpisodeLimits(), row["id"])
    assert traj.error is None and traj.stop_reason is StopReason.NO_TOOL_CALL
    assert traj.messages[1].content == '{"task": "What is 2 + 40? Use the tools."}'
    tools = [m.content for m in traj.messages if m.role == "tool"]
    assert tools[0].startswith("Error: ") and "division by zero" in tools[0] and tools[1] == "42"
    assert [c.ok for c in traj.tool_calls] == [False, True]
    assert traj.reward_parts == {"openenv_reward": 0.0, "steps": 1.0, "done": 0.0}
