"""Bring your own agent (envs.agent_env, envs.agent_proxy): agents written with the real `openai` client,
played by the real runner through the real proxy server; the policy is a scripted sampler here (the
same against a real vLLM server: tests/test_agent_integration.py).

What is checked: an agent's trajectories are token-identical to the native env's (ids, mask,
log-probs, turns, messages, stop reasons, rewards), malformed and unknown calls included; the run's
limits end an agent's episode as they end a native one, and the agent learns why in one line; an
edited history starts a new segment whose context is the fresh render (written out by hand); bad
requests get OpenAI error JSON with one clear message; a failing agent or sampler is an infra error.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp
import pytest
from doc_pages import page_with
from helpers import play_episode

openai = pytest.importorskip("openai", reason="agents are written with the openai client (pip install -e '.[agent]')")

from agent_rl.core.types import Message, StopReason, ToolCall  # noqa: E402
from agent_rl.envs import calculator, calculator_agent  # noqa: E402
from agent_rl.envs.agent_env import AgentEnv  # noqa: E402
from agent_rl.envs.agent_proxy import ProxyError, completion, local_proxy, parse_request  # noqa: E402
from agent_rl.rollout.engine import rollout_groups  # noqa: E402
from agent_rl.rollout.runner import EpisodeLimits  # noqa: E402
from agent_rl.rollout.sampler import SamplerError  # noqa: E402

CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'


def same_trajectory(native, agent) -> None:
    """Everything the trainer reads, equal (tool-call latencies aside: the agent's own time)."""
    for field in ("task_id", "token_ids", "loss_mask", "logprobs", "prompt_len", "turns", "segments", "messages",
                  "stop_reason", "reward", "reward_parts", "error", "policy_version"):
        assert getattr(agent, field) == getattr(native, field), field
    # a call's record says whether it could be read and names an offered tool: what the tool did is the agent's
    assert [(c.name, c.turn) for c in agent.tool_calls] == [(c.name, c.turn) for c in native.tool_calls]
    assert [(c.ok, c.error) for c in agent.tool_calls if not c.ok] == \
        [(c.ok, c.error) for c in native.tool_calls if c.name == "<invalid>" or not c.ok and "unknown tool" in c.error]


async def both(tasks, sampler_of, renderer, limits=EpisodeLimits(), group_size=2):
    native = await rollout_groups(tasks, calculator.make_env, sampler_of(), renderer, limits, group_size)
    agent = await rollout_groups(tasks, calculator_agent.make_env, sampler_of(), renderer, limits, group_size)
    pairs = [(n, a) for gn, ga in zip(native, agent) for n, a in zip(gn.trajectories, ga.trajectories)]
    assert len(pairs) == len(tasks) * group_size
    return pairs


async def test_openai_client_agent_is_token_identical_to_the_native_env(scripted, renderer):
    tasks = calculator.load_tasks(3)
    by_question = {t["question"]: t for t in tasks}
    replies = ['<tool_call>\n{"name": "calculator", "arguments": {"expression": </tool_call>',  # malformed JSON
               '<tool_call>\n{"name": "abacus", "arguments": {}}\n</tool_call>',  # unknown tool
               "Let me compute.\n" + CALL.format("1 +")]  # a tool error

    def script(messages):
        done = sum(m.role == "tool" for m in messages)
        if done < len(replies):
            return replies[done]
        return calculator.solve(by_question[messages[1].content], [m for m in messages if m.content[:6] != "Error:"])

    pairs = await both(tasks, lambda: scripted(script, on_messages=True), renderer, EpisodeLimits(max_turns=6), 2)
    for native, agent in pairs:
        same_trajectory(native, agent)
    native, agent = pairs[0]
    assert agent.stop_reason is StopReason.NO_TOOL_CALL and agent.reward == 1.0 and len(agent.turns) == 5
    assert [c.ok for c in agent.tool_calls] == [False, False, True, True]  # native: the third failed in the tool
    assert [m.name for m in agent.messages if m.role == "tool"] == ["<invalid>", "abacus", "calculator", "calculator"]
    assert agent.messages[5].content.startswith("Error: invalid expression") or "Error" in agent.messages[5].content


async def test_run_limits_end_an_agent_episode_as_a_native_one(scripted, renderer):
    tasks = calculator.load_tasks(2)
    forever = lambda: scripted(lambda prompt: CALL.format("2 * 3"))  # noqa: E731  (never answers)
    for native, agent in await both(tasks, forever, renderer, EpisodeLimits(max_turns=3), 1):
        same_trajectory(native, agent)
        assert agent.stop_reason is StopReason.MAX_TURNS and len(agent.turns) == 3 and agent.reward == 0.0
    for limits, stop in ((EpisodeLimits(max_tokens_per_turn=8), StopReason.LENGTH),
                         (EpisodeLimits(max_turns=9, max_total_tokens=420), StopReason.MAX_TOKENS)):
        for native, agent in await both(tasks, forever, renderer, limits, 1):
            same_trajectory(native, agent)
            assert agent.stop_reason is stop


class Recorder:
    """An agent (the real openai client) that does what `plan` says and keeps what it saw."""

    def __init__(self, plan):
        self.plan, self.seen, self.errors = plan, [], []

    async def __call__(self, task: dict[str, Any], base_url: str) -> str:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": task["question"]}]
            while True:
                try:
                    out = await client.chat.completions.create(model="m", messages=messages)
                except openai.APIStatusError as e:
                    self.errors.append((e.status_code, str(e)))
                    raise
                self.seen.append((out.choices[0].message.content, out.choices[0].finish_reason))
                messages = self.plan(messages, out.choices[0].message.model_dump(exclude_none=True))
                if messages is None:
                    return self.seen[-1][0]


async def play_agent(agent, sampler, renderer, limits=EpisodeLimits(), reward=lambda task, messages, answer: 0.0,
                     **deadlines):
    env = AgentEnv({"id": "t", "question": "Say hi."}, agent, reward, **{"finish_timeout_s": 5, **deadlines})
    return await play_episode(env, sampler, renderer, limits, "t")


async def test_a_cut_turn_goes_back_with_finish_reason_length_then_the_episode_is_over(scripted, renderer):
    agent = Recorder(lambda messages, reply: [*messages, reply, {"role": "user", "content": "More."}])
    traj = await play_agent(agent, scripted(lambda prompt: "a long reply that will not fit"), renderer,
                            EpisodeLimits(max_tokens_per_turn=3))
    assert traj.stop_reason is StopReason.LENGTH and traj.error is None and len(traj.turns) == 1
    assert agent.seen == [(renderer.decode(traj.token_ids[traj.turns[0].start:]), "length")]
    [(status, line)] = agent.errors
    assert status == 410 and line.endswith('is over: its last turn was cut at the run\'s max_tokens_per_turn '
                                           '(finish_reason "length")')


async def test_edited_history_starts_a_new_segment_from_the_fresh_render(scripted, renderer):
    """Turn 1 is sampled after [system, user]; the agent then drops the reply and asks anew: the first
    segment keeps what was sampled, the second starts with the render of the edited history."""
    edited = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi, again."}]
    agent = Recorder(lambda messages, reply: edited if len(agent.seen) == 1 else None)
    traj = await play_agent(agent, scripted(lambda prompt: "Hi." if "again" not in prompt else "Hi again."), renderer)
    first = renderer.render([Message("system", "Be brief."), Message("user", "Say hi.")])
    hi, again = renderer.reply_ids(Message("assistant", "Hi.")), renderer.reply_ids(Message("assistant", "Hi again."))
    [old] = traj.segments
    assert old.token_ids == (*first, *hi) and old.loss_mask == (0,) * len(first) + (1,) * len(hi)
    fresh = renderer.render([Message("system", "Be brief."), Message("user", "Say hi, again.")])
    assert traj.token_ids == (*fresh, *again) and traj.loss_mask == (0,) * len(fresh) + (1,) * len(again)
    assert [(t.segment, t.start) for t in traj.turns] == [(0, len(first)), (1, len(fresh))]
    assert [m.content for m in traj.messages] == ["Be brief.", "Say hi, again.", "Hi again."]
    assert traj.stop_reason is StopReason.NO_TOOL_CALL and agent.seen[-1] == ("Hi again.", "stop")


async def test_a_rewritten_history_whose_render_extends_the_buffer_stays_in_one_segment(scripted, renderer):
    """An assistant note the agent wrote itself is not a continuation (the runner renders the whole
    history), but its render extends what was sampled token for token: no new segment."""
    def plan(messages, reply):
        if len(agent.seen) == 1:
            return [*messages, reply, {"role": "assistant", "content": "(note)"}, {"role": "user", "content": "Go."}]
        return None

    agent = Recorder(plan)
    traj = await play_agent(agent, scripted(lambda prompt: "Ok."), renderer)
    assert traj.segments == () and len(traj.turns) == 2
    full = renderer.render([Message("system", "Be brief."), Message("user", "Say hi."), Message("assistant", "Ok."),
                            Message("assistant", "(note)"), Message("user", "Go.")])
    assert list(traj.token_ids[:traj.turns[1].start]) == full


async def test_sampler_failure_is_an_infra_error_and_the_agent_reads_why(renderer):
    class Down:
        policy_version = 0

        async def sample(self, prompt_ids, params, messages=()):
            raise SamplerError("vLLM server http://127.0.0.1:9 did not answer")

    agent = Recorder(lambda messages, reply: None)
    traj = await play_agent(agent, Down(), renderer)
    assert traj.stop_reason is StopReason.ERROR and "did not answer" in traj.error
    [(status, line)] = agent.errors
    assert status == 410 and "is over: the run stopped it (an error or a deadline" in line


@pytest.mark.parametrize("agent, error", [
    (lambda task, url: asyncio.sleep(0, "no question"),
     "AgentError: the agent returned before asking the model anything"),
    (lambda task, url: _raises(), "AgentError: the agent raised KeyError: 'oops'"),
])
async def test_an_agent_that_fails_is_an_infra_error_with_one_line(scripted, renderer, agent, error):
    traj = await play_agent(agent, scripted(lambda p: "x"), renderer)
    assert traj.stop_reason is StopReason.ERROR and traj.error == error


async def _raises():
    raise KeyError("oops")


HUNG_AFTER_REPLY = ("AgentError: the agent neither asked the model again nor returned within {:g} s of its reply "
                    "(AgentEnv agent_timeout_s)")


async def test_an_agent_that_hangs_is_an_infra_error_with_one_line_never_a_hang(scripted, renderer):
    """Silent before its first request, after a reply, and after its episode is over: each ends within
    its deadline, the episode an error naming the deadline, the agent's task cancelled."""
    stuck = []

    async def silent(task, base_url):
        stuck.append("silent")
        await asyncio.sleep(3600)

    async def after_reply(task, base_url):
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "?"}])
            stuck.append("after reply")
            await asyncio.sleep(3600)  # a tool that never returns

    async def after_the_end(task, base_url):
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            messages = [{"role": "user", "content": "?"}]
            while True:
                try:
                    reply = await client.chat.completions.create(model="m", messages=messages)
                except openai.APIStatusError:
                    stuck.append("after the end")
                    await asyncio.sleep(3600)  # ignores the refusal
                messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "!"}]

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    silent_traj, reply_traj, end_traj = await asyncio.wait_for(asyncio.gather(
        play_agent(silent, scripted(lambda p: "x"), renderer, agent_timeout_s=0.5, finish_timeout_s=0.5),
        # 3 s, not 0.5: its first request must come in time, and building an openai client took longer than
        # 0.5 s on this machine under load (the test then saw the wrong deadline, not a hang)
        play_agent(after_reply, scripted(lambda p: "x"), renderer, agent_timeout_s=3, finish_timeout_s=0.5),
        play_agent(after_the_end, scripted(lambda p: "x"), renderer, EpisodeLimits(max_turns=2), finish_timeout_s=0.5)),
        30)
    assert loop.time() - t0 < 10 and sorted(stuck) == ["after reply", "after the end", "silent"]
    assert silent_traj.stop_reason is StopReason.ERROR and silent_traj.error == (
        "AgentError: the agent sent no request within 0.5 s of its start (AgentEnv agent_timeout_s)")
    assert reply_traj.stop_reason is StopReason.ERROR and len(reply_traj.turns) == 1
    assert reply_traj.error == HUNG_AFTER_REPLY.format(3)
    assert end_traj.stop_reason is StopReason.ERROR and len(end_traj.turns) == 2 and end_traj.error == (
        "AgentError: the agent did not return within 0.5 s after its episode ended (the run's turn or token "
        "limit ended it (rollout.max_turns, rollout.max_total_tokens))")
    assert [t for t in asyncio.all_tasks() if t.get_name().startswith("agent ")] == []  # all cancelled, none left


async def test_an_invalid_first_request_is_the_agents_error_with_the_proxys_line(scripted, renderer):
    async def agent(task, base_url):
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            await client.chat.completions.create(model="m", messages=[{"role": "robot", "content": "hi"}])

    traj = await play_agent(agent, scripted(lambda p: "x"), renderer)
    assert traj.stop_reason is StopReason.ERROR
    assert traj.error == ("AgentError: the agent raised BadRequestError: Error code: 400 - messages[0]: unknown role "
                          "'robot'; use system, user, assistant or tool")


BAD = [
    (b"{not json", 400, "the request body is not valid JSON"),
    (b"[1, 2]", 400, "the request body must be a JSON object, got list"),
    ({"model": "m"}, 400, "messages: a non-empty list of chat messages is required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0]: only text parts are supported, got 'image_url'"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": True}, 400,
     "stream: streaming is not supported by the agent-rl proxy; send stream=false"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400,
     "n: one choice per request (n=1), got 2: an episode is one conversation"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f"}]}, 400,
     'tools[0]: expected {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}'),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, 400,
     "messages[1]: an assistant message with tool_calls that this proxy did not sample; an assistant turn is "
     "rendered from its content, so write such calls into the content in the model's own format and leave "
     "tool_calls out"),
]


async def test_bad_requests_get_openai_error_json_with_one_line_and_the_episode_goes_on(scripted, renderer):
    answers = []

    async def agent(task, base_url):
        async with aiohttp.ClientSession() as http:
            for body, _, _ in BAD:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                async with http.post(base_url + "/chat/completions", data=data) as resp:
                    answers.append((resp.status, (await resp.json())["error"], resp.headers.get("x-should-retry")))
            async with http.get(base_url + "/models") as resp:
                answers.append((resp.status, (await resp.json())["data"][0]["id"], None))
            for url in (base_url.replace("/episodes/", "/episodes/nope") + "/chat/completions",
                        base_url + "/elsewhere"):
                async with http.post(url, json={}) as resp:
                    answers.append((resp.status, (await resp.json())["error"]["message"], None))
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            messages = [{"role": "user", "content": "Hi?"}]
            reply = (await client.chat.completions.create(model="m", messages=messages)).choices[0].message
            return reply.content

    traj = await play_agent(agent, scripted(lambda p: "Hello."), renderer)
    assert traj.error is None and traj.stop_reason is StopReason.NO_TOOL_CALL and len(traj.turns) == 1
    for (status, error, retry), (_, want_status, want) in zip(answers, BAD):
        assert (status, error["message"], error["type"], retry) == (want_status, want, "invalid_request_error", "false")
    assert answers[len(BAD)] == (200, "policy", None)
    assert answers[len(BAD) + 1][0] == 404 and answers[len(BAD) + 1][1].startswith("no open episode 'nope")
    status, line, _ = answers[len(BAD) + 2]
    assert status == 404 and line.startswith("unknown endpoint /episodes/") and \
        line.endswith("/v1/elsewhere; use /episodes/<key>/v1/chat/completions")


CHANGED_REPLY = ("messages[1]: a reply this proxy sampled, with its content or tool_calls changed; send sampled "
                 "replies back as they came (or leave them out: that starts a new training segment)")


async def test_a_second_request_in_flight_and_a_changed_reply_are_refused(scripted, renderer):
    lines = []

    async def agent(task, base_url):
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            ask = lambda messages: client.chat.completions.create(model="m", messages=messages)  # noqa: E731
            both = [asyncio.ensure_future(ask([{"role": "user", "content": q}])) for q in ("A?", "B?")]
            await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)  # the refusal: the other one is held
            answered.set()
            first, second = await asyncio.gather(*both, return_exceptions=True)
            [ok] = [r for r in (first, second) if not isinstance(r, Exception)]
            [refused] = [r for r in (first, second) if isinstance(r, Exception)]
            lines.append(str(refused))
            reply = ok.choices[0].message.model_dump(exclude_none=True)
            history = [{"role": "user", "content": "A?" if ok is first else "B?"}]
            changed = {**reply,
                       "tool_calls": [{**reply["tool_calls"][0],
                                       "function": {"name": "calculator", "arguments": '{"expression": "9"}'}}]}
            try:
                await ask([*history, changed,
                           {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "1"}])
            except openai.BadRequestError as e:
                lines.append(str(e))
            answer = await ask([*history, reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"],
                                                  "content": "1"}])
            return answer.choices[0].message.content

    answered = asyncio.Event()

    class Slow:  # the first request waits until the other one was answered (refused), however late it came
        policy_version = 0
        inner = scripted(lambda p: CALL.format("1") if "<tool_response>" not in p else "One.")

        async def sample(self, prompt_ids, params, messages=()):
            await asyncio.wait_for(answered.wait(), 30)
            return await self.inner.sample(prompt_ids, params, messages)

    traj = await play_agent(agent, Slow(), renderer)
    assert traj.error is None and len(traj.turns) == 2 and traj.segments == ()
    assert lines[0].startswith("Error code: 400 - episode ") and lines[0].endswith(
        "already has a request waiting for its reply; an episode is one conversation: send its requests one at a time")
    assert lines[1] == "Error code: 400 - " + CHANGED_REPLY
    assert traj.messages[-2] == Message("tool", "1", name="calculator")


async def test_an_ended_episode_is_gone_from_the_proxy(scripted, renderer):
    urls = []

    async def agent(task, base_url):
        urls.append(base_url)
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            return (await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "?"}])
                    ).choices[0].message.content

    await play_agent(agent, scripted(lambda p: "!"), renderer)
    async with openai.AsyncOpenAI(base_url=urls[0], api_key="x", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError, match="no open episode"):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "?"}])


def test_wire_format_by_hand():
    reply = Message("assistant", 'x<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><tool_call>{bad',
                    tool_calls=(ToolCall("f", {"a": 1}, "call_1"), ToolCall("", {}, "call_2", "bad")))
    body = completion(reply, ["call_1_1", "call_1_2"], "stop", "m", "chatcmpl-1")
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls" and message["content"] == reply.content
    assert message["tool_calls"] == [
        {"id": "call_1_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "call_1_2", "type": "function", "function": {"name": "", "arguments": "{}"}, "error": "bad"}]
    replies = {"call_1_1": (reply, 0), "call_1_2": (reply, 1)}
    request = parse_request({"model": "m", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
        {**message, "content": None},
        {"role": "tool", "tool_call_id": "call_1_1", "content": "2"},
        {"role": "tool", "tool_call_id": "call_1_2", "content": "Error: bad"},
        {"role": "tool", "content": "stray"}]}, replies)
    assert request.messages == (Message("system", "AB"), reply, Message("tool", "2", name="f"),
                                Message("tool", "Error: bad", name="<invalid>"), Message("tool", "stray"))
    with pytest.raises(ProxyError, match=r"messages\[0\]: a reply this proxy sampled, with its content"):
        parse_request({"messages": [{**message, "content": "edited"}]}, replies)


def test_the_proxy_is_one_server_per_process():
    assert local_proxy() is local_proxy() and local_proxy().url.startswith("http://127.0.0.1:")


def test_the_readme_failure_table_shows_the_lines_the_tests_see():
    """Each row's line in the failure table of "Bring your own agent" (docs/) is the one these tests check (at
    default deadlines)."""
    page = page_with("<!-- example:agent -->").read_text()
    table = page.split("<!-- /commands:agent -->")[1].split("\n## ")[0]
    rows = re.findall(r"^\| .* \|$", table, re.M)[2:]
    lines = [re.findall(r"`([^`]*)`", row.rsplit(" | ", 1)[1])[-1] for row in rows]
    with pytest.raises(ProxyError) as unknown:
        local_proxy().lookup("nope...")
    assert AgentEnv({}, None, None).agent_timeout_s == 100
    assert lines == [BAD[2][2], CHANGED_REPLY, unknown.value.message, "AgentError: the agent raised KeyError: 'oops'",
                     HUNG_AFTER_REPLY.format(100), "episode ... is over: the run stopped it (an error or a deadline: "
                     "the trajectory's error says which)"]
