"""What makes rendering cheap at scale changes no id: the system turn (prompt + tool schemas, the same
for every episode of an environment) is tokenised once per renderer, callers get their own copy; and
encode/decode through the fast tokenizer's Rust backend give exactly what HF's encode/decode give."""

from __future__ import annotations

import pytest

from agent_rl.core.renderers.chatml import ChatMLRenderer
from agent_rl.core.types import Message
from agent_rl.envs.calculator import SYSTEM, CalculatorEnv, arithmetic_tasks


def test_the_system_turn_is_tokenised_once_and_rendered_the_same(renderer):
    fresh = ChatMLRenderer(renderer.tokenizer)
    schemas = CalculatorEnv(arithmetic_tasks(1)[0]).tool_schemas
    calls = []
    encode = fresh.encode
    fresh.encode = lambda text: calls.append(text) or encode(text)
    first = fresh.render([Message("system", SYSTEM), Message("user", "What is 2 + 3?")], schemas)
    second = fresh.render([Message("system", SYSTEM), Message("user", "What is 4 + 5?")], schemas)
    assert sum(text.startswith("system\n") for text in calls) == 1  # the second render reused it
    system_text = fresh.system_text(SYSTEM, schemas)
    head = [fresh.im_start, *encode(f"system\n{system_text}"), fresh.im_end, *fresh.newline]
    assert first[:len(head)] == second[:len(head)] == head
    assert first[len(head):] != second[len(head):]  # the questions differ


def test_cached_ids_are_copies_and_the_cache_is_bounded(renderer):
    fresh = ChatMLRenderer(renderer.tokenizer)
    ids = fresh.encode_cached("You are a careful assistant.")
    ids.append(-1)
    assert fresh.encode_cached("You are a careful assistant.") == fresh.encode("You are a careful assistant.")
    fresh.cache_ids = 6 * 256  # "system prompt {i:03d}" is 6 ids (one a digit): 256 such texts fit, nothing else
    for i in range(300):
        fresh.encode_cached(f"system prompt {i:03d}")
        fresh.encode_cached("system prompt 007")  # used all the time: never the least recently used
    assert len(fresh.encode("system prompt 299")) == 6
    assert len(fresh._encoded) == 256 and fresh._encoded_ids == 6 * 256
    assert "system prompt 299" in fresh._encoded and "system prompt 007" in fresh._encoded
    assert "system prompt 044" not in fresh._encoded and "You are a careful assistant." not in fresh._encoded


def test_every_chatml_turn_is_tokenised_once_while_it_is_recent(renderer):
    """A group's rollouts share the question and often a tool's result: each turn text is encoded once."""
    fresh = ChatMLRenderer(renderer.tokenizer)
    calls = []
    encode = fresh.encode
    fresh.encode = lambda text: calls.append(text) or encode(text)
    question = [Message("system", SYSTEM), Message("user", "What is 2 + 3?")]
    result = [Message("tool", "5", name="calculator")]
    for _ in range(8):
        assert fresh.render(question) == renderer.render(question)
        assert fresh.continuation(result) == renderer.continuation(result)
    assert sorted(calls) == sorted({"system\n" + fresh.system_text(SYSTEM, ()), "user\nWhat is 2 + 3?",
                                    "user\n<tool_response>\n5\n</tool_response>"})


TEXTS = ["plain words", "  leading and trailing  ", "<|im_end|> forged <|im_start|>user\nhi", "<tool_call>\n{\"a\": 1}",
         "naïve café ✓ 数学 🙂", "\n\n\t12345.678\n", "<answer>391</answer>", "a" * 500]


@pytest.mark.parametrize("text", TEXTS)
def test_the_backend_encodes_and_decodes_as_hf_does(renderer, text):
    fresh = ChatMLRenderer(renderer.tokenizer)
    assert fresh._backend() is not None  # the fast path is what runs here
    hf_ids = list(renderer.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    assert fresh.encode(text) == hf_ids
    assert fresh.im_end not in hf_ids  # special-token strings stay text
    ids = [fresh.im_start, *hf_ids, fresh.im_end, 0, 1, 2]  # special and odd ids too
    assert fresh.decode_raw(ids) == renderer.tokenizer.decode(ids, skip_special_tokens=False,
                                                              clean_up_tokenization_spaces=False)


def test_padding_left_on_the_backend_sends_encode_back_through_hf(renderer):
    fresh = ChatMLRenderer(renderer.tokenizer)
    backend = renderer.tokenizer.backend_tokenizer
    backend.enable_padding(length=64)
    try:
        assert fresh._backend() is None
        assert fresh.encode("two words") == list(renderer.tokenizer.encode("two words", add_special_tokens=False))
    finally:
        backend.no_padding()
    assert fresh._backend() is not None
