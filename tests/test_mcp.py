"""MCP tools against a real MCP server process (tests/mcp_toy_server.py), over stdio and streamable HTTP:
listed schemas, calls, error results, deadlines, start failures, crashes and kills mid-episode, shared
and per-episode connections, and whole episodes through the rollout runner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import alive, mcp_over_http

from agent_rl.core.types import Message, StopReason
from agent_rl.envs.mcp_env import MCPEnv
from agent_rl.rollout.engine import rollout_groups
from agent_rl.rollout.runner import EpisodeLimits, run_episode
from agent_rl.tools.base import ToolLike, ToolResult, as_tools
from agent_rl.tools.mcp import MCPStartError, connect, mcp_server

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("no_stray_servers")]
TOY = [sys.executable, str(Path(__file__).with_name("mcp_toy_server.py"))]
LIMITS = EpisodeLimits(max_turns=3, max_tokens_per_turn=256, max_total_tokens=4096)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def http_url():
    proc, url = mcp_over_http(TOY)
    yield url
    stop(proc)


@pytest.fixture(scope="module", params=["stdio", "http"])
async def toy(request, http_url):
    """One connection per transport for the tool-level tests; tool deadline 1 s."""
    target = TOY if request.param == "stdio" else http_url
    conn = await connect(mcp_server(target, name="toy", tool_timeout_s=1.0))
    yield {t.name: t for t in conn.tools}
    await conn.aclose()


async def served(tools) -> tuple[int, int]:
    """(pid, add/divide calls served) of the server behind `tools`."""
    text = (await tools["whoami"].call({})).content
    pid, calls = (int(part.split("=")[1]) for part in text.split())
    return pid, calls


async def test_listed_tools_arrive_as_agent_rl_tool_schemas(toy):
    assert list(toy) == ["add", "divide", "buggy", "sleep", "whoami", "crash"]
    assert toy["add"].schema == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.\n\nArgs:\n    a: The first addend.\n    b: The second addend.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}}
    assert all(isinstance(t, ToolLike) for t in toy.values())
    assert as_tools(list(toy.values())) == list(toy.values())  # passed through, not wrapped


async def test_calls_give_results_and_errors_give_error_messages(toy):
    _, before = await served(toy)
    assert await toy["add"].call({"a": 2, "b": 40}) == ToolResult(ok=True, content="42")
    assert (await toy["add"].call({"a": -2, "b": 0})).content == "-2"
    res = await toy["divide"].call({"a": 1, "b": 0})  # the tool raises the SDK's ToolError
    assert not res.ok and res.content == "Error: cannot divide by zero" and \
        res.error == "divide failed: cannot divide by zero"
    res = await toy["buggy"].call({})  # an unexpected exception: the server hides its text
    assert not res.ok and res.content == "Error: Error executing tool buggy"
    res = await toy["add"].call({"a": "2", "c": 1})  # refused here: the server never sees it
    assert not res.ok and res.content == ("Error: invalid arguments for add: unknown argument 'c'; "
                                          "'b' is a required property; a: '2' is not of type 'integer'")
    assert (await toy["add"].call([1, 2])).error == "arguments of add must be a JSON object, got list"
    _, after = await served(toy)
    assert after - before == 3  # add twice, divide once; the refused calls never reached the server


async def test_slow_tool_hits_the_deadline_and_the_session_goes_on(toy):
    t0 = time.perf_counter()
    res = await toy["sleep"].call({"seconds": 30})
    assert time.perf_counter() - t0 < 3.0
    assert not res.ok and res.content == "Error: sleep did not finish within 1 s"
    assert (await toy["add"].call({"a": 1, "b": 1})).content == "2"


@pytest.mark.parametrize("target, options, start, end", [
    (["/nonexistent/mcp-server"], {}, "MCP server 'mcp-server' (/nonexistent/mcp-server) did not start: ",
     "FileNotFoundError: [Errno 2] No such file or directory: '/nonexistent/mcp-server'"),
    ([*TOY, "--fail-start"], {}, f"MCP server 'mcp_toy_server' ({' '.join(TOY)} --fail-start) did not start: ",
     "MCPError: Connection closed; its stderr ends: toy server: no configuration found, giving up"),
    ([sys.executable, "-c", "import time; time.sleep(60)"], {"start_timeout_s": 1.0, "name": "sleeper"},
     "MCP server 'sleeper' (", "did not start: no handshake within 1 s"),
    ("http://127.0.0.1:9/mcp", {}, "MCP server '127.0.0.1:9' (http://127.0.0.1:9/mcp) did not start: ",
     "ConnectError: All connection attempts failed"),
], ids=["no-such-command", "exits-at-start", "never-answers", "nothing-listening"])
async def test_a_server_that_does_not_start_is_one_clear_line(target, options, start, end):
    t0 = time.perf_counter()
    with pytest.raises(MCPStartError) as info:
        await connect(mcp_server(target, **options))
    assert time.perf_counter() - t0 < 10.0  # a 1 s start deadline, then a bounded shutdown
    message = str(info.value)
    assert "\n" not in message and message.startswith(start) and message.endswith(end), message


async def test_a_spec_can_expose_only_some_tools_and_must_name_real_ones(http_url):
    conn = await connect(mcp_server(http_url, tools=["divide", "add"]))
    assert [t.name for t in conn.tools] == ["add", "divide"]  # in the server's order
    await conn.aclose()
    with pytest.raises(MCPStartError, match=r"did not start: ValueError: it has no tool named nope, sub$"):
        await connect(mcp_server(http_url, tools=["add", "sub", "nope"]))


async def test_crash_mid_call_answers_that_call_and_every_later_one():
    conn = await connect(mcp_server(TOY, name="toy"))
    tools = {t.name: t for t in conn.tools}
    pid, _ = await served(tools)
    res = await tools["crash"].call({})
    assert not res.ok and res.content.startswith("Error: MCP server 'toy' stopped during crash (")
    assert res.content.endswith("its stderr ends: toy server: crashing on purpose")
    res = await tools["add"].call({"a": 1, "b": 2})
    assert not res.ok and res.content.startswith("Error: MCP server 'toy' is not running (it closed the connection")
    assert res.content.endswith("add was not called")
    t0 = time.perf_counter()
    await conn.aclose()
    assert time.perf_counter() - t0 < 3.0 and not alive(pid)


async def test_http_server_killed_mid_episode_gives_error_messages_not_a_hang():
    proc, url = mcp_over_http(TOY)
    try:
        conn = await connect(mcp_server(url, name="toy-http", tool_timeout_s=5.0))
        tools = {t.name: t for t in conn.tools}
        assert (await tools["add"].call({"a": 1, "b": 2})).content == "3"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        t0 = time.perf_counter()
        for _ in range(2):
            res = await tools["add"].call({"a": 1, "b": 2})
            assert not res.ok and "MCP server 'toy-http'" in res.content
        assert time.perf_counter() - t0 < 6.0
        await conn.aclose()
    finally:
        stop(proc)


class ToyEnv(MCPEnv):
    """The toy server's tools; reward 1 when the final answer says 42."""

    def __init__(self, task, shared=True, tools=()):
        super().__init__([mcp_server(task.get("server", TOY), name="toy", tool_timeout_s=1.0)], tools=tools,
                         shared=shared)
        self.task = task

    async def initial_messages(self):
        return [Message("system", "Use the tools."), Message("user", "What is 2 + 40?")]

    async def reward(self, messages):
        return float("42" in messages[-1].content)


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


async def test_episodes_through_the_runner_get_one_tool_message_per_call(scripted_calls, renderer):
    """Four calls in one turn (a result, an error result, a deadline, bad arguments), then the answer."""
    turn = "\n".join([call("add", '{"a": 2, "b": 40}'), call("divide", '{"a": 1, "b": 0}'),
                      call("sleep", '{"seconds": 30}'), call("add", '{"a": 2}')])
    tasks = [{"id": "a"}, {"id": "b"}]
    t0 = time.perf_counter()
    groups = await rollout_groups(tasks, ToyEnv, scripted_calls([turn], lambda p: "It is 42."), renderer, LIMITS, 2)
    # a server start, then four episodes side by side, each waiting 1 s for sleep
    assert time.perf_counter() - t0 < 20.0
    for t in (t for g in groups for t in g.trajectories):
        assert t.stop_reason is StopReason.NO_TOOL_CALL and t.reward == 1.0, t.error
        assert [m.content for m in t.messages if m.role == "tool"] == [
            "42", "Error: cannot divide by zero", "Error: sleep did not finish within 1 s",
            "Error: invalid arguments for add: 'b' is a required property"]
        assert [(r.name, r.ok) for r in t.tool_calls] == [("add", True), ("divide", False), ("sleep", False),
                                                          ("add", False)]


async def test_shared_connection_serves_every_episode_and_a_dead_one_is_replaced(scripted, renderer):
    pids = []
    for _ in range(2):
        async with ToyEnv({}) as env:
            pids.append((await served({t.name: t for t in env.tools}))[0])
    assert pids[0] == pids[1] and alive(pids[0])  # one server process for both episodes
    async with ToyEnv({}) as env:
        traj = await run_episode(env, scripted(lambda p: call("crash", "{}") if "<tool_response>" not in p
                                               else "No idea."), renderer, LIMITS, "crash")
    assert "MCP server 'toy' stopped during crash" in traj.messages[3].content and not traj.tool_calls[0].ok
    async with ToyEnv({}) as env:  # the next episode starts a fresh server
        pid, _ = await served({t.name: t for t in env.tools})
    assert pid != pids[0] and alive(pid)


async def test_an_unshared_env_owns_its_server_process_and_closes_it():
    async with ToyEnv({}, shared=False) as env:
        pid, calls = await served({t.name: t for t in env.tools})
        assert calls == 0 and alive(pid)
    assert not alive(pid)


async def test_a_server_that_cannot_start_is_the_episodes_error_line(scripted, renderer):
    tasks = [{"id": "x", "server": [*TOY, "--fail-start"]}]
    groups = await rollout_groups(tasks, ToyEnv, scripted(lambda p: "hi"), renderer, LIMITS, 2)
    for t in groups[0].trajectories:
        assert t.stop_reason is StopReason.ERROR and t.infra_error and "\n" not in t.error
        assert t.error.startswith("environment could not start: MCPStartError: MCP server 'toy' (")
        assert t.error.endswith("did not start: MCPError: Connection closed; its stderr ends: "
                                "toy server: no configuration found, giving up")


async def test_tool_names_must_be_unique_across_servers_and_local_tools():
    def add(a: int, b: int) -> int:
        """Add locally."""
        return a + b

    env = ToyEnv({}, shared=False, tools=[add])
    with pytest.raises(ValueError, match=r"duplicate tool names: \['add'\]"):
        await env.__aenter__()
    assert env._owned == []  # what it opened is closed again


def test_shared_servers_stop_when_the_process_exits(tmp_path):
    code = ("import asyncio; from agent_rl.tools.mcp import shared_connection, mcp_server\n"
            "async def main():\n"
            f"    conn = await shared_connection(mcp_server({TOY!r}))\n"
            "    tools = {t.name: t for t in conn.tools}\n"
            "    print((await tools['whoami'].call({})).content.split()[0].split('=')[1])\n"
            "asyncio.run(main())\n")
    repo = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False,
                         env={**os.environ, "PYTHONPATH": repo}, cwd=repo)
    assert out.returncode == 0, out.stderr
    assert not alive(int(out.stdout.strip()))
