"""VLLMSampler's reading of a /v1/completions choice, without a server: ids and log-probs as sent, each token
tagged with the request's version, an abort told apart, the echoed prompt checked against the ids we sent
(list or tuple alike), and one clear error for anything else."""

from __future__ import annotations

import pytest

from agent_rl.rollout.sampler import SamplerError, _completion


def choice(ids=(5, 6, 7), logprobs=(-0.1, -0.2, -0.3), finish="stop", echoed=(1, 2, 3)):
    body = {"token_ids": list(ids), "logprobs": {"token_logprobs": list(logprobs)}, "finish_reason": finish}
    if echoed is not None:
        body["prompt_token_ids"] = list(echoed)
    return {"choices": [body]}


@pytest.mark.parametrize("prompt", [[1, 2, 3], (1, 2, 3)])
def test_a_completion_comes_back_as_sent(prompt):
    out = _completion(choice(), prompt, 4, "http://x")
    assert out.token_ids == (5, 6, 7) and out.logprobs == (-0.1, -0.2, -0.3)
    assert out.finish_reason == "stop" and out.policy_version == 4 and out.versions == (4, 4, 4)
    assert _completion(choice(finish="length"), prompt, 0, "u").finish_reason == "length"
    # a request a weight push aborted: `VLLMSampler.sample` goes on from its tokens
    assert _completion(choice(finish="abort"), prompt, 0, "u").finish_reason == "abort"
    assert _completion(choice(finish="eos"), prompt, 0, "u").finish_reason == "stop"
    assert _completion(choice(echoed=None), prompt, 0, "u").token_ids == (5, 6, 7)


@pytest.mark.parametrize("data, message", [
    (choice(echoed=(1, 2, 4)), "changed the prompt tokens"),
    (choice(logprobs=(-0.1,)), "sent 3 token ids but 1 log-probs"),
    ({"choices": []}, "unexpected completion"),
    ({"choices": [{"token_ids": [1]}]}, "return_token_ids support"),
])
def test_anything_else_is_one_clear_error(data, message):
    with pytest.raises(SamplerError, match=message):
        _completion(data, [1, 2, 3], 0, "http://x")
