"""The units environment on the real example MCP server (examples/mcp_units_server.py): conversions
worked out by hand, episodes with the scripted sampler over stdio and HTTP, wrong answers, malformed
calls, bad rows, and vLLM."""

from __future__ import annotations

import sys

import pytest
from helpers import mcp_over_http

from agent_rl.core.types import StopReason
from agent_rl.envs.mcp_units import SERVER_FILE, UnitsEnv, load_tasks, make_env, solve, units_module
from agent_rl.rollout.engine import rollout_groups
from agent_rl.rollout.runner import EpisodeLimits, run_episode

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("no_stray_servers")]
LIMITS = EpisodeLimits(max_turns=4, max_tokens_per_turn=256, max_total_tokens=4096)


@pytest.fixture(scope="module")
def units_url():
    """The example server over streamable HTTP on a free port."""
    proc, url = mcp_over_http([sys.executable, str(SERVER_FILE)])
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def test_conversions_by_hand():
    convert = units_module().convert_value
    assert convert(1, "mi", "km") == pytest.approx(1.609344)
    assert convert(12, "in", "ft") == pytest.approx(1.0)
    assert convert(1, "lb", "g") == pytest.approx(453.59237)
    assert convert(1, "gal", "cup") == pytest.approx(16.0)
    assert convert(100, "C", "F") == pytest.approx(212.0) and convert(0, "K", "C") == pytest.approx(-273.15)
    with pytest.raises(ValueError, match="^unknown unit 'meters'; known units: m, km, "):
        convert(1, "meters", "km")
    with pytest.raises(ValueError, match=r"^cannot convert length \(m\) to mass \(kg\)$"):
        convert(1, "m", "kg")


def test_tasks_are_deterministic_cover_every_quantity_and_splits_differ():
    rows = load_tasks(8, seed=3)
    assert rows == load_tasks(8, seed=3) and rows != load_tasks(8, seed=3, split="eval")
    assert {units_module().UNITS[r["from_unit"]][0] for r in rows} == {"length", "mass", "volume", "temperature"}
    convert = units_module().convert_value
    for r in rows:
        assert r["answer"] == pytest.approx(convert(r["value"], r["from_unit"], r["to_unit"]), rel=1e-5)


async def test_tool_using_episode_earns_full_reward_and_a_wrong_answer_none(scripted, renderer):
    task = {"id": "t", "question": "How many kilometers are in 5 miles?", "answer": 8.04672,
            "value": 5, "from_unit": "mi", "to_unit": "km"}
    async with make_env(task) as env:
        assert [t.name for t in env.tools] == ["convert", "list_units"]
        traj = await run_episode(env, scripted(lambda m: solve(task, m), on_messages=True), renderer, LIMITS, "t")
    assert traj.messages[3].content == "5 mi = 8.04672 km" and traj.messages[-1].content == "The answer is 8.04672."
    assert traj.reward == 1.0 and traj.reward_parts == {"correct": 1.0} and traj.tool_calls[0].ok
    # the tool's 6 significant digits are the answer: a rounded one is as wrong as a neighbour (reward audit)
    for reply, reward in [("It is 8.04672 km.", 1.0), ("About 8.05 km.", 0.0), ("It is 8.2 km.", 0.0),
                          ("No idea.", 0.0)]:
        async with make_env(task) as env:
            traj = await run_episode(env, scripted(lambda p, r=reply: r), renderer, LIMITS, "t")
        assert traj.reward == reward and traj.tool_calls == ()


async def test_malformed_calls_get_error_messages_and_the_episode_goes_on(scripted_calls, renderer):
    task = load_tasks(1, seed=0)[0]
    bad = [('<tool_call>\n{"name": "convert", "arguments": {"value": 3, "from_unit": "meters", "to_unit": "ft"}}\n'
            '</tool_call>'),
           '<tool_call>\n{"name": "convert", "arguments": {"value": "three", "from_unit": "m"}}\n</tool_call>',
           '<tool_call>\n{"name": "list_units", "arguments": {}}\n</tool_call>']
    async with make_env(task) as env:
        traj = await run_episode(env, scripted_calls(bad, lambda m: solve(task, m)), renderer, LIMITS, task["id"])
    tool = [m.content for m in traj.messages if m.role == "tool"]
    assert tool[0].startswith("Error: unknown unit 'meters'; known units: m, km, cm")
    assert tool[1] == ("Error: invalid arguments for convert: 'to_unit' is a required property; "
                       "value: 'three' is not of type 'number'")
    assert tool[2].startswith("length: m, km, cm, mm, mi, yd, ft, in; mass: kg")
    assert traj.stop_reason is StopReason.MAX_TURNS  # three bad turns and one right call use the four turns
    async with make_env(task) as env:
        traj = await run_episode(env, scripted_calls(bad[:1], lambda m: solve(task, m)), renderer, LIMITS, task["id"])
    assert traj.reward == 1.0 and [r.ok for r in traj.tool_calls] == [False, True]


async def test_solver_over_http_on_every_quantity(units_url, scripted, renderer):
    tasks = [{**t, "mcp_url": units_url} for t in load_tasks(8, seed=1)]
    by_id = {t["id"]: t for t in tasks}

    def script(messages):
        task = next(t for t in tasks if t["question"] == messages[1].content)
        return solve(by_id[task["id"]], messages)

    groups = await rollout_groups(tasks, make_env, scripted(script, on_messages=True), renderer, LIMITS, 1)
    trajs = [g.trajectories[0] for g in groups]
    assert [t.reward for t in trajs] == [1.0] * 8, [t.error or t.messages[-1].content for t in trajs]


@pytest.mark.parametrize("change, message", [
    ({"answer": None}, "mcp_units task 'bad' has no 'answer' column"),
    ({"mcp_url": "localhost:8765"},
     "mcp_units task 'bad': column 'mcp_url' must be an http(s) URL, got 'localhost:8765'"),
])
def test_malformed_row_names_the_row_and_the_column(change, message):
    task = {k: v for k, v in {**load_tasks(1)[0], "id": "bad", **change}.items() if v is not None}
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        UnitsEnv(task)


@pytest.mark.integration
async def test_rollouts_against_vllm_keep_token_truth(play_on_server):
    limits = EpisodeLimits(max_turns=3, max_tokens_per_turn=48, max_total_tokens=2048)
    groups = await play_on_server(load_tasks(2, seed=0), make_env, limits)
    for t in (t for g in groups for t in g.trajectories):
        assert t.reward in (0.0, 1.0) and t.reward_parts == {"correct": t.reward}
