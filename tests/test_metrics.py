"""Rollout metrics against hand counts."""

import dataclasses

import pytest
from helpers import trajectory

from agent_rl.core.types import Segment, StopReason, ToolCallRecord, Turn
from agent_rl.runs.metrics import lag_metrics, rollout_metrics


def traj(calls=(), stop=StopReason.NO_TOOL_CALL, reward=0.0, n_tokens=10, sampled=4, turns=1):
    """`n_tokens` tokens, the last `sampled` of them sampled, in `turns` turns."""
    return trajectory(reward, stop, ids=(7,) * n_tokens, prompt_len=n_tokens - sampled, logprobs=(0.0,) * n_tokens,
                      turns=[0.0] * turns, calls=calls)


def call(name, ok=True, latency=0.1):
    return ToolCallRecord(name, ok, None if ok else "bad", latency, 0)


def test_rollout_metrics_by_hand():
    ts = [
        traj([call("calc"), call("calc", ok=False, latency=0.3)], reward=1.0, turns=3),  # 2 calls, 1 failed
        traj([call("search")], reward=0.0, turns=2),
        traj([], reward=1.0, stop=StopReason.LENGTH, n_tokens=20, sampled=10),
        traj([], reward=0.0),
        traj([], stop=StopReason.ERROR),  # infra error: counted, kept out of the rates
    ]
    m = rollout_metrics(ts)
    assert m["rollouts"] == 5
    assert m["infra_error_rate"] == pytest.approx(1 / 5)
    assert m["tool_use_rate"] == pytest.approx(2 / 4)
    assert m["tool_calls_per_traj"] == pytest.approx(3 / 4)
    assert m["tool_failure_rate"] == pytest.approx(1 / 3)
    assert m["tool/calc/calls_per_traj"] == pytest.approx(2 / 4)
    assert m["tool/calc/failure_rate"] == pytest.approx(1 / 2)
    assert m["tool/calc/latency_mean_s"] == pytest.approx(0.2)
    assert m["tool/search/failure_rate"] == 0.0
    assert m["turns_mean"] == pytest.approx((3 + 2 + 1 + 1) / 4)
    assert m["tokens_mean"] == pytest.approx((10 + 10 + 20 + 10) / 4)
    assert m["sampled_tokens_mean"] == pytest.approx((4 + 4 + 10 + 4) / 4)
    assert m["truncation_rate"] == pytest.approx(1 / 4)
    assert m["reward_mean"] == pytest.approx(0.5)
    assert m["reward_time_sum_s"] == 0.0
    assert m["stop/no_tool_call"] == pytest.approx(3 / 5)
    assert m["stop/length"] == pytest.approx(1 / 5) and m["stop/error"] == pytest.approx(1 / 5)


def test_all_infra_errors_give_no_behaviour_rates():
    m = rollout_metrics([traj(stop=StopReason.ERROR)])
    assert m == {"rollouts": 1.0, "infra_error_rate": 1.0}


def test_lag_counts_each_token_with_the_version_that_sampled_it():
    """At step 5: a closed segment of 2 tokens by version 3 (lag 2); the open one 6 sampled tokens, the first 2 by
    version 3, the other 4 by 4 (a push in the middle of the turn: lag 1), and 2 context tokens (not counted).
    Tokens: 4 at lag 2, 4 at lag 1: mean 1.5, max 2, shares 1/2 each. By the turn's version (3) alone every
    token would be lag 2."""
    closed = Segment((1, 2, 3), (0, 1, 1), (0.0, -1.0, -1.0), (-1, 3, 3))
    t = trajectory(ids=(7,) * 8, prompt_len=2, logprobs=(0.0,) * 8, turns=[Turn(2, 8, "stop", 3)], policy_version=3,
                   segments=(closed,), versions=(-1, -1, 3, 3, 4, 4, 4, 4))
    assert lag_metrics([t], 5) == {"lag/mean": 1.5, "lag/max": 2.0, "lag/share_1": 0.5, "lag/share_2": 0.5}
    # versions not known (-1 on a sampled token): the trajectory's
    old = Segment((1, 2), (0, 1), (0.0, -1.0))
    assert lag_metrics([dataclasses.replace(t, segments=(old,))], 5)["lag/share_2"] == 3 / 7  # 1 + 2 of 7


def replies_traj(replies, tools=("calculator",), stop=StopReason.NO_TOOL_CALL):
    """An episode whose sampled turns are `replies` (after a system and user message, tool messages between)."""
    from agent_rl.core.types import Message

    messages = [Message("system", "s"), Message("user", "q")]
    for r in replies:
        messages += [r, Message("tool", "out")]
    return trajectory(stop=stop, ids=(7,) * 4, prompt_len=2, logprobs=(0.0,) * 4,
                      turns=[Turn(2, 4, "stop", 0) for _ in replies], messages=messages[:-1], tools=tools)


def test_violations_of_the_call_format_per_sampled_turn_by_hand(renderer):
    from agent_rl.core.renderers.chatml import Qwen25Renderer
    from agent_rl.core.renderers.qwen3 import Qwen3Renderer
    from agent_rl.runs.metrics import reply_violations, violation_metrics

    def reply(text, family=renderer):
        return family.parse(family.encode(text) + [family.im_end])

    good = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    broken = '<tool_call>\n{"name": "calculator", "arguments": {"expression": </tool_call>'
    unknown = '<tool_call>\n{"name": "calc", "arguments": {}}\n</tool_call>'
    after = "<answer>5</answer>\n" + good
    boxed_after_call = good + "\nso \\boxed{5}"  # the answer comes after the call: no violation
    assert reply_violations(reply(good), ("calculator",)) == dict.fromkeys(
        ("call_in_reasoning", "malformed_call", "unknown_tool", "call_after_answer"), False)
    assert reply_violations(reply(broken + good), ("calculator",))["malformed_call"]
    assert reply_violations(reply(unknown), ("calculator",))["unknown_tool"]
    assert not reply_violations(reply(unknown), None)["unknown_tool"]  # the offered tools not recorded
    assert reply_violations(reply(unknown), ())["unknown_tool"]  # an episode that offered none
    assert reply_violations(reply(after), ("calculator",))["call_after_answer"]
    assert not reply_violations(reply(boxed_after_call), ("calculator",))["call_after_answer"]
    assert reply_violations(reply("\\boxed{5} " + good), ("calculator",))["call_after_answer"]
    # Qwen3 reads calls only after </think>: one written while thinking is a violation its renderer counts
    qwen3 = Qwen3Renderer(renderer.tokenizer)
    thinking = "<think>\nlet me " + good + "\n</think>\n\nThe answer is 5."
    assert qwen3.calls_in_reasoning(thinking) == 1 and qwen3.parse_tool_calls(thinking) == []
    assert qwen3.calls_in_reasoning("<think>\nstill " + good) == 1  # never closed: all of it is reasoning
    assert qwen3.calls_in_reasoning("<think>\nfine\n</think>\n\n" + good) == 0
    assert Qwen25Renderer(renderer.tokenizer).calls_in_reasoning(thinking) == 0  # no reasoning block: none
    assert reply_violations(reply(thinking, qwen3), ("calculator",), qwen3.calls_in_reasoning)["call_in_reasoning"]
    # 6 sampled turns over two episodes (an infrastructure error left out): malformed 1, unknown 2, after 1
    ts = [replies_traj([reply(good), reply(broken), reply(unknown)]),
          replies_traj([reply(after), reply(unknown), reply("The answer is 5.")]),
          replies_traj([reply(broken)], stop=StopReason.ERROR)]
    assert violation_metrics(ts) == {"violation/call_in_reasoning": 0.0, "violation/malformed_call": 1 / 6,
                                     "violation/unknown_tool": 2 / 6, "violation/call_after_answer": 1 / 6,
                                     "violation/any": 4 / 6}
    assert violation_metrics(ts[2:]) == {}
