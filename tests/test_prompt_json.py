"""A prompt's JSON written from its conversation's last prompt (`rollout.prompt_json`) is the prompt, id for id,
whatever the conversation key matches: a prompt that extends the last one, the same prompt again, a history the
environment replaced, a key shared by two conversations, no key, and after the least recently used are
dropped. And VLLMSampler sends exactly the prompt ids in each turn of an episode (a stand-in server reads them)."""

from __future__ import annotations

import json

from test_push_in_flight import StandInVLLM

from agent_rl.core.types import Message
from agent_rl.rollout.prompt_json import PromptJSON
from agent_rl.rollout.sampler import SamplingParams, VLLMSampler


def test_each_text_is_its_prompt_whatever_the_key_matches():
    prompts = PromptJSON()
    a, b = object(), object()
    turn1 = [1, 2, 3]
    turn2 = [*turn1, 40, 50, 6]
    cases = [
        (turn1, a, "[1,2,3]"),
        (turn2, a, "[1,2,3,40,50,6]"),  # extends a's last prompt
        (list(turn2), a, "[1,2,3,40,50,6]"),  # the same prompt again
        ([9, 2, 3, 40], a, "[9,2,3,40]"),  # a replaced history: not an extension
        ([9, 2, 3, 40, 7], a, "[9,2,3,40,7]"),
        ([1, 2], b, "[1,2]"),
        ([1, 2, 3, 4], a, "[1,2,3,4]"),  # a's key, another conversation's ids
        ([1, 2, 0], b, "[1,2,0]"),
        ([5], None, "[5]"),  # no key: written whole
        ([], b, "[]"),
        ([8], b, "[8]"),
    ]
    for ids, key, text in cases:
        assert prompts.text(ids, key) == text
        assert json.loads(text) == ids


def test_only_the_new_ids_are_written_when_the_prompt_extends_the_last(monkeypatch):
    import agent_rl.rollout.prompt_json as module

    written = []
    real = module.ids_json
    monkeypatch.setattr(module, "ids_json", lambda ids: written.append(list(ids)) or real(ids))
    prompts, episode = PromptJSON(), object()
    context = list(range(1000, 1600))
    assert json.loads(prompts.text(context, episode)) == context
    context = [*context, 7, 8, 9]
    assert json.loads(prompts.text(context, episode)) == context
    assert written == [list(range(1000, 1600)), [7, 8, 9]]


def test_the_least_recently_used_conversations_are_dropped_past_max_ids():
    prompts = PromptJSON(max_ids=10)
    keys = [object() for _ in range(4)]
    for k in keys:
        prompts.text([1, 2, 3, 4], k)
    assert len(prompts._kept) == 2 and prompts._kept_ids == 8
    assert prompts.text([1, 2, 3, 4, 5], keys[0]) == "[1,2,3,4,5]"  # dropped: written whole, still right
    assert list(prompts._kept) == [id(keys[3]), id(keys[0])]


async def test_the_sampler_sends_each_turns_prompt_exactly():
    async with StandInVLLM() as server, VLLMSampler([server.url]) as sampler:
        conversation = (Message("system", "s"), Message("user", "q"))
        prompt = [5, 6, 7]
        for turn in range(3):
            out = await sampler.sample(prompt, SamplingParams(max_tokens=4, seed=turn), messages=conversation)
            assert server.served[-1][0] == tuple(prompt)  # what the server read, id for id
            prompt = [*prompt, *out.token_ids, 11, 12]  # the next turn: samples and the env's reply
        other = await sampler.sample([5, 6, 9], SamplingParams(max_tokens=2), messages=conversation)
        assert server.served[-1][0] == (5, 6, 9) and len(other.token_ids) == 2  # same key, unrelated ids
