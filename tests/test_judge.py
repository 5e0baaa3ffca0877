"""The LLM judge: rankings read by hand, a scripted judge server (canned replies, errors, a slow one), the
cache and the prompt in the run directory, the config's judge in a session, and one real call to vLLM."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
from aiohttp import web
from helpers import trajectory

from agent_rl.config.file import load_config
from agent_rl.core.types import Message, Trajectory, Turn
from agent_rl.envs.dataset import RubricEnv
from agent_rl.rewards.group import rubric_group_reward
from agent_rl.rewards.judge import DEFAULT_PROMPT, NEUTRAL, LLMJudge, parse_ranking, rank_scores
from agent_rl.rewards.rubric import RewardTerm, Rubric
from agent_rl.rollout.engine import rollout_groups
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.session import Session, env_of, judging, open_session


@pytest.mark.parametrize("text, n, ranking", [
    ("2 > 1 > 3", 3, [1, 0, 2]),
    ("Ranking: [3] > [1] > [2]", 3, [2, 0, 1]),
    ("Answer 1 is wrong. So: 2>1", 2, [1, 0]),
    ("first 1 > 2 > 3, on reflection 3 > 2 > 1", 3, [2, 1, 0]),  # the last complete ranking
    ("3 > 1 > 2 then 1 > 1", 3, [2, 0, 1]),  # an invalid chain after a valid one is skipped
    ("2 > 1", 3, None),  # not every answer ranked
    ("1 > 2 > 2", 3, None),
    ("4 > 1 > 2", 3, None),
    ("I like the second one best.", 2, None),
    ("", 2, None),
])
def test_parse_ranking(text, n, ranking):
    assert parse_ranking(text, n) == ranking


def test_rank_scores_by_hand():
    assert rank_scores([1, 0, 2]) == [0.5, 1.0, 0.0]
    assert rank_scores([3, 0, 1, 2]) == pytest.approx([2 / 3, 1 / 3, 0.0, 1.0])


class ScriptedJudge:
    """A tiny OpenAI-compatible server: each request gets `reply(body)` (a string, or an int HTTP status)."""

    def __init__(self, reply):
        self.reply, self.requests = reply, []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append((body, request.headers.get("Authorization")))
        out = self.reply(body)
        if isinstance(out, int):
            return web.Response(status=out, text="model overloaded\ntry later")
        if out == "sleep":
            await asyncio.sleep(10)
        if out.startswith("abort:"):  # cut short by a weight push's pause (vLLM's finish_reason "abort")
            return web.json_response({"choices": [{"message": {"role": "assistant", "content": out[6:]},
                                                   "finish_reason": "abort"}]})
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": out}}]})


@pytest.fixture
async def judge_server():
    runners = []

    async def start(reply) -> tuple[str, ScriptedJudge]:
        scripted = ScriptedJudge(reply)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", scripted.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}", scripted

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_a_scripted_judge_ranks_and_is_asked_once_per_group(judge_server, tmp_path):
    url, server = await judge_server(lambda body: "After comparing: 3 > 1 > 2")
    async with LLMJudge(url + "/", "judge-model", out_dir=tmp_path / "judge", api_key="k3y") as judge:
        verdict = await judge.judge("What is 6 * 7?", ["42", "41", "It is 42."], reference="42")
        again = await judge.judge("What is 6 * 7?", ["42", "41", "It is 42."], reference="42")
    assert verdict.scores == [0.5, 0.0, 1.0] and verdict.ok and not verdict.cached
    assert again.scores == verdict.scores and again.cached and len(server.requests) == 1
    body, auth = server.requests[0]
    assert auth == "Bearer k3y" and body["model"] == "judge-model" and body["temperature"] == 0.0
    [message] = body["messages"]
    assert "What is 6 * 7?" in message["content"] and "Reference answer: 42" in message["content"]
    assert "[1] 42\n\n[2] 41\n\n[3] It is 42." in message["content"] and "Rank all 3 answers" in message["content"]
    assert (tmp_path / "judge" / "prompt.txt").read_text() == DEFAULT_PROMPT
    # a resumed run reads the cache: the same group costs no request and gets the same scores
    async with LLMJudge(url, "judge-model", out_dir=tmp_path / "judge") as resumed:
        same = await resumed.judge("What is 6 * 7?", ["42", "41", "It is 42."], reference="42")
    assert same.scores == verdict.scores and same.cached
    assert len(server.requests) == 1


@pytest.mark.parametrize("reply, reason", [
    (lambda body: "They are all fine!", "its reply ranks no permutation of answers 1..2: 'They are all fine!'"),
    (lambda body: 503, "answered HTTP 503: model overloaded try later"),
    (lambda body: "sleep", "did not answer within 0.5 s"),
])
async def test_a_judge_that_cannot_judge_scores_neutral_with_one_logged_line(judge_server, tmp_path, caplog, reply,
                                                                             reason):
    url, server = await judge_server(reply)
    async with LLMJudge(url, timeout_s=0.5, out_dir=tmp_path) as judge:
        with caplog.at_level(logging.WARNING, logger="agent_rl.rewards.judge"):
            verdict = await asyncio.wait_for(judge.judge("q", ["a", "b"]), 5)
            await asyncio.wait_for(judge.judge("q", ["a", "b"]), 5)
    assert verdict.scores == [NEUTRAL, NEUTRAL] and not verdict.ok and reason in verdict.reason
    [line, _] = [r.getMessage() for r in caplog.records]
    assert "\n" not in line and reason in line and line.endswith("its group of 2 answers scores 0.5 each")
    cached = "ranks no permutation" in reason  # a garbage reply is cached; a failed request is asked again
    assert len(server.requests) == (1 if cached else 2)
    assert len((tmp_path / "cache.jsonl").read_text().splitlines() if cached else []) == (1 if cached else 0)


async def test_a_reply_cut_short_by_a_weight_push_is_asked_again_and_not_cached(judge_server, tmp_path):
    """The run's own server, paused by a push of merged weights, aborts the judge's request: its partial reply
    ("2 >", a ranking of nothing) is neither read nor cached; the request is sent again."""
    replies = iter(["abort:2 >", "2 > 1"])
    url, server = await judge_server(lambda body: next(replies))
    async with LLMJudge(url, out_dir=tmp_path) as judge:
        verdict = await judge.judge("q", ["a", "b"])
    assert verdict.scores == [0.0, 1.0] and verdict.ok and len(server.requests) == 2
    assert [json.loads(x)["reply"] for x in (tmp_path / "cache.jsonl").read_text().splitlines()] == ["2 > 1"]
    url, server = await judge_server(lambda body: "abort:")
    async with LLMJudge(url) as judge:
        verdict = await judge.judge("q", ["a", "b"])
    assert not verdict.ok and "aborted the request 3 times in a row" in verdict.reason and len(server.requests) == 3


async def test_an_unreachable_judge_is_one_line(tmp_path):
    from agent_rl.rollout.serving.vllm.server import free_port

    async with LLMJudge(f"http://127.0.0.1:{free_port()}") as judge:
        verdict = await judge.judge("q", ["a", "b"])
    assert not verdict.ok and verdict.reason.startswith(f"the judge at {judge.url} is unreachable (")


def test_a_template_without_its_placeholders_is_refused():
    with pytest.raises(ValueError, match=r"judge prompt template lacks \{answers\}"):
        LLMJudge("http://x", prompt="Rank the answers to {question}.")
    judge = LLMJudge("http://x", prompt='{"question": {question}, "answers": [{answers}], "n": {n}}{reference}')
    assert judge.render("q?", ["a", ""]) == '{"question": q?, "answers": [[1] a\n\n[2] (no final answer)], "n": 2}'


async def test_the_judge_is_a_rubric_group_term(judge_server, scripted, renderer):
    url, server = await judge_server(lambda body: "2 > 1")

    def exact(completions, answer, **kwargs):
        return [float(c[-1]["content"].endswith(str(a))) for c, a in zip(completions, answer)]

    async with LLMJudge(url) as judge:
        rubric = Rubric([(exact, 1.0), RewardTerm(judge, 0.5, group=True)])
        replies = iter(["It is 42", "The answer, computed carefully, is 42"])
        groups = await rollout_groups([{"id": "q", "question": "What is 6 * 7?", "answer": "42"}],
                                      lambda task: RubricEnv(task, [], rubric), scripted(lambda p: next(replies)),
                                      renderer, EpisodeLimits(max_turns=1), 2, group_reward=rubric_group_reward(rubric))
    assert [t.reward for t in groups[0].trajectories] == [1.0, 1.5]
    assert [t.reward_parts["judge"] for t in groups[0].trajectories] == [0.0, 1.0]
    assert "[2] The answer, computed carefully, is 42" in server.requests[0][0]["messages"][0]["content"]


def finished(text: str) -> Trajectory:
    messages = (Message("user", "What is 2 + 2?"), Message("assistant", text))
    return trajectory(float(text.endswith("4")), ids=(1, 2), turns=[Turn(1, 2, "stop", 0)], messages=messages,
                      env="toy")


async def test_the_configs_judge_joins_a_sessions_group_rewards(judge_server, tmp_path, smol_dir, renderer):
    url, server = await judge_server(lambda body: "1 > 2" if "Reference answer: 4" in body["messages"][0]["content"]
                                     else "no idea")
    cfg = load_config(None, ["rollout.envs={toy: 1}", "judge.url=run", "judge.weight=0.5"])
    session = Session(cfg, smol_dir, renderer, env_of(cfg))
    assert session.env.group_reward is None
    async with judging(session, [url], tmp_path) as judged:
        hook = judged.env.group_reward
        good = await hook({"id": "q", "answer": 4, "env": "toy"}, [finished("It is 4"), finished("5")])
        bad = await hook({"id": "q", "env": "toy"}, [finished("It is 4"), finished("5")])
    assert [(r.value, r.parts) for r in good] == [(0.5, {"judge": 1.0, "judge_failed": 0.0}),
                                                  (0.0, {"judge": 0.0, "judge_failed": 0.0})]
    assert [(r.value, r.parts) for r in bad] == [(0.25, {"judge": 0.5, "judge_failed": 1.0})] * 2
    assert (tmp_path / "judge" / "prompt.txt").is_file() and len(server.requests) == 2
    off = Session(load_config(None, []), smol_dir, renderer, session.env)  # judge.url: null
    async with judging(off, [url], tmp_path) as same:
        assert same is off


@pytest.mark.parametrize("overrides, message", [
    (["judge.url=run", "judge.prompt=/no/such/prompt.txt"], "judge.prompt: no file '/no/such/prompt.txt'"),
    (["judge.url=run", "judge.api_key_env=AGENT_RL_TEST_NO_SUCH_KEY"],
     "judge.api_key_env: the environment variable AGENT_RL_TEST_NO_SUCH_KEY is not set"),
])
def test_judge_settings_that_cannot_work_fail_when_the_session_opens(overrides, message):
    with pytest.raises(ValueError) as info:
        open_session(load_config(None, overrides))
    assert str(info.value) == message


@pytest.mark.integration
async def test_one_real_call_to_the_test_vllm_server(vllm_server, tmp_path, caplog):
    """The tiny random model answers with garbage (at temperature 0, its first token ends the reply: ''):
    the call goes through to a chat completion, the reply is cached, and the garbage is a neutral score
    with the reason logged."""
    async with LLMJudge(vllm_server.url, "base", out_dir=tmp_path, max_tokens=16, timeout_s=60) as judge:
        with caplog.at_level(logging.WARNING, logger="agent_rl.rewards.judge"):
            verdict = await judge.judge("What is 2 + 2?", ["4", "5", "It is 4."], reference="4")
        again = await judge.judge("What is 2 + 2?", ["4", "5", "It is 4."], reference="4")
    [entry] = [json.loads(x) for x in Path(tmp_path / "cache.jsonl").read_text().splitlines()]
    assert len(entry["key"]) == 64 and isinstance(entry["reply"], str)
    assert judge.stats == {"requests": 1, "cache_hits": 1, "failures": 2}
    assert verdict.scores == [NEUTRAL] * 3 and not verdict.ok and again.scores == verdict.scores
    # a chat completion came back (an HTTP error or a malformed body would say so instead)
    assert caplog.records[0].getMessage().startswith("judge: its reply ranks no permutation of answers 1..3: ")
