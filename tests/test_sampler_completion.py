"""VLLMSampler's reading of a /v1/completions choice, without a server: ids and log-probs as sent, each token
tagged with the request's version, an abort told apart, the echoed prompt checked against the ids we sent
(list or tuple alike), and one clear error for anything else. The request's JSON and the response's read
(orjson, and Python's json for what orjson refuses), and each turn's prompt sent id for id (a stand-in server)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import orjson
import pytest
from helpers import StandInVLLM

from agent_rl.core.types import Message
from agent_rl.rollout.sampler import SamplerError, SamplingParams
from agent_rl.rollout.serving.vllm.sampler import (
    VLLMSampler,
    _token_texts,
    read_response,
    request_body,
    response_completion,
)


def choice(ids=(5, 6, 7), logprobs=(-0.1, -0.2, -0.3), finish="stop", echoed=(1, 2, 3)):
    body = {"token_ids": list(ids), "logprobs": {"token_logprobs": list(logprobs)}, "finish_reason": finish}
    if echoed is not None:
        body["prompt_token_ids"] = list(echoed)
    return {"choices": [body]}


@pytest.mark.parametrize("prompt", [[1, 2, 3], (1, 2, 3)])
def test_a_completion_comes_back_as_sent(prompt):
    out = response_completion(choice(), prompt, 4, "http://x")
    assert out.token_ids == (5, 6, 7) and out.logprobs == (-0.1, -0.2, -0.3)
    assert out.finish_reason == "stop" and out.policy_version == 4 and out.versions == (4, 4, 4)
    assert response_completion(choice(finish="length"), prompt, 0, "u").finish_reason == "length"
    # a request a weight push aborted: `VLLMSampler.sample` goes on from its tokens
    assert response_completion(choice(finish="abort"), prompt, 0, "u").finish_reason == "abort"
    assert response_completion(choice(finish="eos"), prompt, 0, "u").finish_reason == "stop"
    assert response_completion(choice(echoed=None), prompt, 0, "u").token_ids == (5, 6, 7)


@pytest.mark.parametrize("data, message", [
    (choice(echoed=(1, 2, 4)), "changed the prompt tokens"),
    (choice(logprobs=(-0.1,)), "sent 3 token ids but 1 log-probs"),
    ({"choices": []}, "unexpected completion"),
    ({"choices": [{"token_ids": [1]}]}, "return_token_ids support"),
])
def test_anything_else_is_one_clear_error(data, message):
    with pytest.raises(SamplerError, match=message):
        response_completion(data, [1, 2, 3], 0, "http://x")


@pytest.mark.parametrize("ids, logprobs", [(("5", 6, 7), (-0.1, -0.2, -0.3)), ((5, 6.0, 7), (-0.1, -0.2, -0.3)),
                                           ((5, 6, 7), (-0.1, None, -0.3)), ((5, 6, 7), (-0.1, "x", -0.3)),
                                           ((5, 2**70, 7), (-0.1, -0.2, -0.3))])
def test_an_id_that_is_not_an_int_or_a_log_prob_not_a_number_is_refused(ids, logprobs):
    with pytest.raises(SamplerError, match="unexpected completion"):
        response_completion(choice(ids=ids, logprobs=logprobs), [1, 2, 3], 0, "http://x")


def test_a_response_is_read_as_json_infinity_included_and_anything_else_is_one_line():
    body = b'{"choices": [{"token_ids": [5], "logprobs": {"token_logprobs": [-0.25]}, "finish_reason": "stop"}]}'
    assert read_response(body, "u")["choices"][0]["logprobs"]["token_logprobs"] == [-0.25]
    # orjson refuses -Infinity and NaN, which Python's json writes: such a response is still read
    odd = read_response(b'{"lp": [-Infinity, NaN, -0.5]}', "u")["lp"]
    assert odd[0] == -math.inf and math.isnan(odd[1]) and odd[2] == -0.5
    with pytest.raises(SamplerError, match=r"^http://x sent a response that is not JSON: '<html>bad gateway"):
        read_response(b"<html>bad gateway</html>", "http://x")


def test_the_request_is_the_prompt_ids_and_the_sampling_parameters():
    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, stop_token_ids=(2, 3), seed=11)
    body = json.loads(request_body("p-v3", orjson.dumps((1, 2, 3)), params))
    assert body == {"prompt": [1, 2, 3], "model": "p-v3", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                    "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False,
                    "stop_token_ids": [2, 3], "seed": 11}
    assert "seed" not in json.loads(request_body("base", b"[1]", replace(params, seed=None)))


def response(echo: bytes, text: str = "hi") -> bytes:
    return (b'{"choices":[{"index":0,"text":' + json.dumps(text).encode() + b',"token_ids":[5,6],'
            b'"logprobs":{"token_logprobs":[-0.5,-0.25]},"finish_reason":"stop","prompt_token_ids":' + echo + b'}]}')


def test_an_echo_that_is_the_prompts_json_byte_for_byte_is_left_out_and_any_other_is_compared():
    prompt = [1, 2, 3]
    sent = orjson.dumps(prompt)
    cut = read_response(response(b"[1,2,3]"), "u", sent)
    assert cut["choices"][0]["prompt_token_ids"] is None  # compared as bytes, not read
    assert cut["choices"][0]["token_ids"] == [5, 6] and response_completion(cut, prompt, 0, "u").token_ids == (5, 6)
    # the same ids written another way: read, then compared id for id
    spaced = read_response(response(b"[1, 2, 3]"), "u", sent)
    assert spaced["choices"][0]["prompt_token_ids"] == prompt and response_completion(spaced, prompt, 0, "u").token_ids
    # other ids, or the sent ids followed by more: read, and refused
    for echo in (b"[1,2,4]", b"[1,2,3,4]", b"[1,2]"):
        data = read_response(response(echo), "u", sent)
        assert data["choices"][0]["prompt_token_ids"] == json.loads(echo)
        with pytest.raises(SamplerError, match="changed the prompt tokens"):
            response_completion(data, prompt, 0, "u")
    # the key's text inside a string is escaped, so it is never taken for the key
    tricky = read_response(response(b"[9]", text='"prompt_token_ids":[1,2,3]'), "u", sent)
    assert tricky["choices"][0]["text"] == '"prompt_token_ids":[1,2,3]'
    with pytest.raises(SamplerError, match="changed the prompt tokens"):
        response_completion(tricky, prompt, 0, "u")


def vllm_response(tokens: list[str], echo: bytes = b"[1,2,3]") -> bytes:
    """A response as vLLM 0.32 writes it for `logprobs: 0` (keys in its order; tests/test_integration_vllm.py checks
    them on the real server): each token's offset, log-prob, text and top-1 entry."""
    logprobs = [-0.5 - i for i in range(len(tokens))]
    offsets = [len("".join(tokens[:k])) for k in range(len(tokens))]
    lp = {"text_offset": offsets, "token_logprobs": logprobs, "tokens": tokens,
          "top_logprobs": [{t: p} for t, p in zip(tokens, logprobs)]}
    body = orjson.dumps({"index": 0, "text": "".join(tokens), "logprobs": lp, "finish_reason": "stop",
                         "stop_reason": None, "token_ids": list(range(10, 10 + len(tokens))), "prompt_logprobs": None})
    return b'{"id":"cmpl-1","choices":[' + body[:-1] + b',"prompt_token_ids":' + echo + b'}],"usage":null}'


# token texts that look like the keys and brackets the cut looks for: each is escaped inside its string
TRICKY = ["Hi", ' "x"', ']},"finish_reason":', '"prompt_token_ids":[1,2,3]', "]", "},{", "\\", "é🙂",
          "prompt_token_ids", "finish_reason"]


@pytest.mark.parametrize("tokens", [["a", "b"], TRICKY, []])
def test_the_token_texts_vllm_sends_with_each_log_prob_are_left_out_unread(tokens):
    raw, sent = vllm_response(tokens), orjson.dumps([1, 2, 3])
    assert _token_texts(raw) is not None
    cut, whole = read_response(raw, "u", sent), orjson.loads(raw)
    for key in ("text_offset", "tokens", "top_logprobs"):
        del whole["choices"][0]["logprobs"][key]
    whole["choices"][0]["prompt_token_ids"] = None  # the echo is the ids sent: compared as bytes, left out too
    assert cut == whole
    out = response_completion(cut, [1, 2, 3], 0, "u")
    assert out.token_ids == tuple(range(10, 10 + len(tokens)))
    assert out.logprobs == tuple(-0.5 - i for i in range(len(tokens)))
    with pytest.raises(SamplerError, match="changed the prompt tokens"):  # another echo is still read and compared
        response_completion(read_response(vllm_response(tokens, echo=b"[1,2,4]"), "u", sent), [1, 2, 3], 0, "u")


@pytest.mark.parametrize("raw", [
    b'{"choices":[{"logprobs":{"token_logprobs":[-0.5],"text_offset":[0],"tokens":["a"]},"finish_reason":"stop"}]}',
    b'{"choices":[{"logprobs":{"text_offset":[0], "token_logprobs":[-0.5],"tokens":["a"]},"finish_reason":"stop"}]}',
    b'{"choices":[{"logprobs":{"text_offset":[0],"token_logprobs":[-0.5],"top_logprobs":[{"a":-0.5}]},"x":1}]}',
    b'{"choices":[{"logprobs":{"text_offset":[0],"token_logprobs":[-0.5],"tokens":["a"]}}]}',
    b'{"choices":[{"logprobs":{"text_offset":[0,',
])
def test_a_response_written_otherwise_is_read_whole(raw):
    """Keys in another order, spaces, a key missing, no finish_reason after them, a body cut short: no cut, and
    what is read (or refused) is what reading it whole gives."""
    assert _token_texts(raw) is None
    try:
        expected = orjson.loads(raw)
    except orjson.JSONDecodeError:
        with pytest.raises(SamplerError, match="not JSON"):
            read_response(raw, "u")
        return
    assert read_response(raw, "u") == expected


async def test_the_sampler_sends_each_turns_prompt_exactly():
    async with StandInVLLM() as server, VLLMSampler([server.url]) as sampler:
        conversation = (Message("system", "s"), Message("user", "q"))
        prompt = [5, 6, 7]
        for turn in range(3):
            out = await sampler.sample(prompt, SamplingParams(max_tokens=4, seed=turn), messages=conversation)
            assert server.served[-1][0] == tuple(prompt)  # what the server read, id for id
            prompt = [*prompt, *out.token_ids, 11, 12]  # the next turn: samples and the env's reply
        other = await sampler.sample([5, 6, 9], SamplingParams(max_tokens=2), messages=conversation)
        assert server.served[-1][0] == (5, 6, 9) and len(other.token_ids) == 2  # unrelated ids, same conversation
