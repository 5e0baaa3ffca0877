"""What Qwen2.5-Coder-0.5B-Instruct writes on BFCL's parallel questions, read as the eval reads it (#44 item 3).

tests/qwen25_bfcl_parallel_replies.json holds three of its real replies, as sampled (token text, turn end included),
from the run its `source` names: of 60 (30 parallel, 30 parallel_multiple), 59 were one call in one ```json block
where the question asks for two or more, and one (parallel_93) explained three calls in prose, a ```json block
each, until the 256-token limit cut it. So the zero on parallel is the model's: its replies hold one call, and the
parser reads that one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_rl.core.renderers.choose import get_renderer

DATA = json.loads((Path(__file__).with_name("qwen25_bfcl_parallel_replies.json")).read_text())
REPLIES = {r["id"]: r for r in DATA["replies"]}


@pytest.fixture(scope="module")
def parse(qwen25_tokenizer):
    renderer = get_renderer(qwen25_tokenizer)  # bare JSON calls read as calls: Qwen2.5's default

    def parse_reply(text: str):
        return renderer.parse(qwen25_tokenizer.encode(text, add_special_tokens=False))
    return parse_reply


def calls(message) -> list[tuple[str, dict]]:
    return [(c.name, c.arguments) for c in message.tool_calls]


def test_one_call_in_one_fenced_block_is_read_as_that_call(parse):
    # "Play songs from the artists Taylor Swift and Maroon 5, with a play time of 20 minutes and 15 minutes
    # respectively": two calls asked, one written; BFCL: parallel_function_checker_no_order:wrong_count
    reply = REPLIES["parallel_0"]
    assert reply["finish_reason"] == "stop" and reply["bfcl_error"].endswith("wrong_count")
    assert calls(parse(reply["sampled"])) == [("spotify.play", {"artist": "Taylor Swift", "duration": 20})]
    multiple = REPLIES["parallel_multiple_0"]
    assert calls(parse(multiple["sampled"])) == [
        ("math_toolkit.sum_of_multiples", {"lower_limit": 1, "upper_limit": 1000, "multiples": [3, 5]})]


def test_calls_explained_in_prose_are_not_calls_and_the_same_blocks_alone_are(parse):
    reply = REPLIES["parallel_93"]
    assert reply["finish_reason"] == "length"  # cut: the runner never parses such a turn (a failed call)
    text = reply["sampled"]
    assert text.count("```json") == 3 and text.startswith("To estimate the travel time")
    assert parse(text).tool_calls == ()  # prose around the blocks: an explanation, not a call
    blocks = [b.split("```", 1)[0] for b in text.split("```json")[1:3]]  # its two finished blocks, alone
    bare = "\n".join(f"```json{b}```" for b in blocks)
    assert calls(parse(bare)) == [
        ("route.estimate_time", {"start_location": "NYC", "end_location": "Miami",
                                 "stops": ["Philadelphia", "Washington D.C", "Atlanta"]}),
        ("route.estimate_time", {"start_location": "NYC", "end_location": "Miami", "stops": ["Washington D.C"]})]


def test_the_kept_replies_are_the_runs_own():
    assert DATA["source"].startswith("agent-rl eval --benchmark bfcl --set model.name=qwen2.5-coder-0.5b")
    assert set(REPLIES) == {"parallel_0", "parallel_multiple_0", "parallel_93"}
    assert all(r["sampled"].endswith("<|im_end|>") for r in REPLIES.values() if r["finish_reason"] == "stop")
