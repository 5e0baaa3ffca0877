"""The system turn (prompt + tool schemas, the same for every episode of an environment) is tokenised
once per renderer: the ids are exactly those of tokenising it afresh, and callers get their own copy."""

from __future__ import annotations

from agent_rl.core.chatml import ChatMLRenderer
from agent_rl.core.types import Message
from envs.calculator import SYSTEM, CalculatorEnv, arithmetic_tasks


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
    for i in range(300):
        fresh.encode_cached(f"system prompt {i}")
    assert len(fresh._encoded) == 256 and "system prompt 299" in fresh._encoded
