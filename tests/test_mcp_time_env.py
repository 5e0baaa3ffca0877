"""The time environment on MCP's real reference time server (mcp-server-time over stdio): conversions and
answers by hand, the solver's episode token-exact, the server's own errors as tool messages, a server
that cannot start as a one-line episode error, a missing package, and vLLM."""

from __future__ import annotations

import pytest

from agent_rl.core.types import Message, StopReason, ToolCall
from agent_rl.rollout.engine import rollout_groups
from agent_rl.rollout.runner import EpisodeLimits, run_episode

pytest.importorskip("mcp_server_time", reason="pip install 'agent-rl[mcp-time]'")
from agent_rl.envs import mcp_time

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_stray_servers")]
LIMITS = EpisodeLimits(max_turns=4, max_tokens_per_turn=256, max_total_tokens=4096)
TOKYO_BOGOTA = {"id": "tb", "question": "When it is 09:30 in Tokyo (Asia/Tokyo), what time is it in Bogota "
                "(America/Bogota)?", "answer": "19:30", "time": "09:30", "source": "Asia/Tokyo",
                "target": "America/Bogota"}


def test_conversions_by_hand():
    assert mcp_time.convert("09:30", "Asia/Tokyo", "America/Bogota") == "19:30"  # UTC+9 -> UTC-5: a day back
    assert mcp_time.convert("00:20", "Asia/Kathmandu", "Asia/Seoul") == "03:35"  # +5:45 -> +9
    assert mcp_time.convert("23:50", "Pacific/Honolulu", "Asia/Kolkata") == "15:20"  # -10 -> +5:30, next day
    with pytest.raises(ValueError, match=r"^mcp_time: zone 'Europe/London' changes its UTC offset"):
        mcp_time.convert("12:00", "Europe/London", "Asia/Tokyo")


@pytest.mark.parametrize("reply, answer", [
    ("It is 19:30.", "19:30"),
    ("09:30 in Tokyo is 19:30 in Bogota.", "19:30"),  # the question's own time does not count
    ("It is 7:05 there.", "07:05"),
    ("Either 19:30 or 20:30.", None),  # a list earns nothing
    ("It is 09:30.", None),  # the question echoed
    ("No idea.", None),
    ("It is 19:30:00.", None),  # not HH:MM
    ("It is １９:３０.", "１９:３０"),  # look-alike digits: a time stated, never the answer (reward audit)
    ("It is ０４:３５, 19:30.", None),  # a look-alike time beside the right one is a second answer
    # a call written as text is no answer (the reward audit's bare-JSON carrier): the time only in its arguments
    ('{"name": "convert_time", "arguments": {"source_timezone": "America/Bogota", "time": "19:30", '
     '"target_timezone": "America/Bogota"}}', None),
    ('<tool_call>\n{"name": "convert_time", "arguments": {"time": "19:30"}}', None),  # unclosed markup
])
def test_the_answer_is_the_one_time_stated_besides_the_questions(reply, answer):
    assert mcp_time.time_answer(reply, "09:30") == answer


def test_tasks_are_deterministic_without_dst_and_the_splits_never_share_a_question():
    rows = mcp_time.load_tasks(50, seed=2)
    assert rows == mcp_time.load_tasks(50, seed=2) and len({r["id"] for r in rows}) == 50
    held_out = mcp_time.load_tasks(50, seed=2, split="eval")
    assert {r["time"][-1] for r in rows} == {"0"} and {r["time"][-1] for r in held_out} == {"5"}
    for r in rows + held_out:
        assert r["answer"] == mcp_time.convert(r["time"], r["source"], r["target"]) and r["source"] != r["target"]
        assert r["question"].startswith(f"When it is {r['time']} in ")


async def test_the_solver_on_the_real_server_token_exact(scripted, renderer):
    sampler = scripted(lambda m: mcp_time.solve(TOKYO_BOGOTA, m), on_messages=True)
    async with mcp_time.make_env(TOKYO_BOGOTA) as env:
        assert [t.name for t in env.tools] == ["get_current_time", "convert_time"]  # the server's own tools
        traj = await run_episode(env, sampler, renderer, LIMITS, "tb")
        tools = env.tool_schemas
    assert traj.reward == 1.0 and traj.reward_parts == {"correct": 1.0}
    assert traj.messages[3].role == "tool" and '"datetime": ' in traj.messages[3].content
    assert traj.messages[-1].content == "It is 19:30." and traj.tool_calls[0].ok
    # the sampled ids are the trained ones, and the buffer is exactly a render of the whole conversation
    sampled = [i for i, m in zip(traj.token_ids, traj.loss_mask) if m == 1]
    reply_ids = [renderer.reply_ids(mcp_time.solve(TOKYO_BOGOTA, traj.messages[:2])), renderer.encode_reply(
        "It is 19:30.") + [renderer.im_end]]
    assert sampled == reply_ids[0] + reply_ids[1]
    full = renderer.render(list(traj.messages), tools, add_generation_prompt=False)
    assert list(traj.token_ids) + renderer.encode("\n") == full
    for before, after in zip(sampler.calls, sampler.calls[1:]):
        assert after[:len(before)] == before


async def test_a_wrong_answer_earns_nothing_and_the_servers_errors_come_back_as_tool_messages(scripted_calls,
                                                                                              renderer):
    bad = ToolCall("convert_time", {"source_timezone": "Tokyo", "time": "09:30", "target_timezone": "America/Bogota"})
    late = ToolCall("convert_time", {"source_timezone": "Asia/Tokyo", "time": "9:30pm",
                                     "target_timezone": "America/Bogota"})
    calls = [renderer.format_reply("", [bad]), renderer.format_reply("", [late])]
    async with mcp_time.make_env(TOKYO_BOGOTA) as env:
        traj = await run_episode(env, scripted_calls(calls, lambda m: "It is 20:30."), renderer, LIMITS, "tb")
    tool = [m.content for m in traj.messages if m.role == "tool"]
    assert tool == ["Error: Invalid timezone: 'No time zone found with key Tokyo'",
                    "Error: Invalid time format. Expected HH:MM [24-hour format]"]
    assert [r.ok for r in traj.tool_calls] == [False, False] and traj.stop_reason is StopReason.NO_TOOL_CALL
    assert traj.reward == 0.0


async def test_a_server_that_cannot_start_is_a_one_line_episode_error(scripted, renderer, monkeypatch, tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'no such module: mcp_server_time' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv(mcp_time.PYTHON_VAR, str(fake))
    groups = await rollout_groups([TOKYO_BOGOTA], mcp_time.make_env, scripted(lambda p: "It is 19:30."),
                                  renderer, LIMITS, 1)
    traj = groups[0].trajectories[0]
    assert traj.stop_reason is StopReason.ERROR and "\n" not in traj.error
    assert traj.error.startswith("environment could not start: MCPStartError: MCP server 'time' (")
    assert "no such module: mcp_server_time" in traj.error


def test_a_missing_server_is_one_line_naming_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(mcp_time.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"^the mcp_time environment needs MCP's reference time server: pip install "
                                         r"'agent-rl\[mcp-time\]' \(or set AGENT_RL_MCP_TIME_PYTHON to a Python"):
        mcp_time.make_env(TOKYO_BOGOTA)
    monkeypatch.setenv(mcp_time.PYTHON_VAR, str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=r"^AGENT_RL_MCP_TIME_PYTHON='.*nope' is not an executable Python$"):
        mcp_time.make_env(TOKYO_BOGOTA)


def test_a_malformed_row_names_the_row_and_the_column():
    with pytest.raises(ValueError, match=r"^mcp_time task 'tb' has no 'time' column$"):
        mcp_time.TimeEnv({k: v for k, v in TOKYO_BOGOTA.items() if k != "time"})


def test_the_solver_answers_at_once_when_asked_to():
    assert mcp_time.solve(TOKYO_BOGOTA, [], direct=True) == Message("assistant", "It is 19:30.")


@pytest.mark.integration
@pytest.mark.timeout(300)  # the session's vLLM server may start within this test (1-3 min under load)
async def test_rollouts_against_vllm_keep_token_truth(play_on_server):
    limits = EpisodeLimits(max_turns=3, max_tokens_per_turn=48, max_total_tokens=2048)
    groups = await play_on_server(mcp_time.load_tasks(2, seed=0), mcp_time.make_env, limits)
    for t in (t for g in groups for t in g.trajectories):
        assert t.reward in (0.0, 1.0) and t.reward_parts == {"correct": t.reward}
