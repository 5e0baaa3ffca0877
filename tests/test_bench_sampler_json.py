"""bench/sampler_json.py compares like with like: the request orjson writes is the one the standard library writes,
field for field, and the three ways of reading a response give the same completion (`one` asserts it); its row
has every figure, each a time, and the ratios of those figures."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is not installed: the checkout's

from agent_rl.rollout.sampler import SamplingParams
from agent_rl.rollout.serving.vllm.sampler import request_body
from bench.sampler_json import one, stdlib_body


def test_the_two_requests_are_the_same_json():
    params = SamplingParams(max_tokens=9, temperature=0.7, stop_token_ids=(2, 5), seed=3)
    assert json.loads(request_body("m", b"[1,22,333]", params)) == json.loads(stdlib_body("m", [1, 22, 333], params))


def test_a_row_times_both_sides_of_each_step():
    row = one(context=50, reply=10, rng=random.Random(1))
    assert (row["context"], row["reply"]) == (50, 10)
    for key in ("write_json_us", "write_us", "read_json_us", "read_orjson_us", "read_us"):
        assert 0 < row[key] < 10_000, key
    assert row["write_ratio"] == round(row["write_json_us"] / row["write_us"], 1)
    assert row["read_ratio"] == round(row["read_json_us"] / row["read_us"], 1)
