"""bench/shared/sim_responses.py: the responses made from fragments are `response_json`'s bytes, whatever the
prefix, the ending and the token texts (quotes, backslashes, non-ASCII, empty)."""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is not installed: the checkout's

from bench.shared.sim_responses import Responses, response_json, token_pieces

PIECES = ["a", " b", '"q"', "\\", "é🙂", "", "\n", "</tool_call>", "x" * 30, "}]"]


@pytest.mark.parametrize("n, tail", [(0, []), (0, [3, 4]), (5, []), (7, [9, 2, 0, 5]), (40, [1])])
def test_a_response_from_fragments_is_response_jsons_bytes(n, tail):
    base = [i % len(PIECES) for i in range(3, 60)]
    prompt = [1, 2, 3, 4]
    fast = Responses(base, PIECES).write(orjson.dumps(prompt), len(prompt), n, tail)
    assert fast == response_json(prompt, [*base[:n], *tail], PIECES)
    assert orjson.loads(fast)["choices"][0]["logprobs"]["text_offset"][:1] == ([0] if n + len(tail) else [])


def test_an_echo_that_is_a_prefix_of_the_base_and_real_token_texts(renderer):
    pieces = token_pieces(renderer)
    base = renderer.encode("Let me think about this step by step, then call the calculator. " * 20)
    writer = Responses(base, pieces)
    assert writer.ids_json(50) == orjson.dumps(base[:50]) and writer.ids_json(0) == b"[]"
    tail = renderer.encode('\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>')
    assert writer.write(writer.ids_json(90), 90, 33, tail) == response_json(base[:90], [*base[:33], *tail], pieces)
