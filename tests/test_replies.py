"""What an evaluation keeps beside its scores: each episode's replies with the calls parsed, the verdict and the
checker's error type, the violations of each sampled turn; read back as `agent-rl view`'s page, a step per policy.

Episodes are real ones (tests/helpers.py's scripted AddEnv, played by conftest's `play_plan`, the real SmolLM2
renderer); the page is opened in a headless Chromium in tests/test_trace_page.py.
"""

from __future__ import annotations

import json

import pytest

from agent_rl import cli
from agent_rl.runs import view
from agent_rl.runs.replies import read_replies, replies_path, write_replies

PLAN = {"t-learn": ["tool_then_right", "bad_call_then_right"], "t-crash": ["wrong", "crash"]}


def test_replies_go_beside_the_report():
    assert str(replies_path("runs/eval/bfcl-1.json")) == "runs/eval/bfcl-1.replies.jsonl"
    assert str(replies_path("out/report")) == "out/report.replies.jsonl"


async def test_each_episode_is_kept_with_its_verdict_and_violations(tmp_path, play_plan, renderer):
    groups = await play_plan(PLAN)
    learn, crash = groups
    valid = {"valid": True, "error_type": None, "errors": []}
    wrong = {"valid": False, "error_type": "simple_function_checker:wrong_count", "errors": ["one call, not two"]}
    episodes = {"base": [(learn.trajectories[0], valid), (learn.trajectories[1], wrong),
                         (crash.trajectories[0], wrong), (crash.trajectories[1], None)],
                "runs/sft": [(learn.trajectories[0], valid)]}
    path = write_replies(tmp_path / "r.replies.jsonl", episodes, renderer)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["policy"], r["task_id"], r["group"], r["index"], r["group_size"]) for r in records] == [
        ("base", "t-learn", 0, 0, 2), ("base", "t-learn", 0, 1, 2), ("base", "t-crash", 1, 0, 2),
        ("base", "t-crash", 1, 1, 2), ("runs/sft", "t-learn", 0, 0, 1)]
    first, bad = records[0], records[1]
    assert first["verdict"] == valid and bad["verdict"]["error_type"] == "simple_function_checker:wrong_count"
    # the replies' text and the calls parsed from it; the malformed call is the second episode's first violation
    [reply] = [m for m in first["messages"] if m["role"] == "assistant" and m["tool_calls"]]
    assert reply["tool_calls"] == [{"name": "add", "arguments": {"a": 2, "b": 3}, "id": "call_1", "error": None}]
    assert first["violations"] == [[], []] and bad["violations"] == [["malformed_call"], []]
    assert records[3]["verdict"] is None and records[3]["error"] == "RuntimeError: sampler went away"
    # the text of the tokens stays, their ids and log-probs do not
    assert all(set(s) == {"runs"} for r in records for s in r["segments"])
    steps = read_replies(path)
    assert [(s["step"], s["label"], len(s["trajectories"])) for s in steps] == [(1, "base", 4), (2, "runs/sft", 1)]
    assert steps[0]["metrics"] == {"episodes": 4, "errors": 1, "valid_share": 1 / 3}


async def test_agent_rl_view_writes_the_page_of_an_evaluations_replies(tmp_path, play_plan, renderer, capsys):
    groups = await play_plan({"t-learn": ["tool_then_right"]})
    path = write_replies(tmp_path / "eval.replies.jsonl", {"base": [(groups[0].trajectories[0], {
        "valid": False, "error_type": "multi_turn:force_terminated", "errors": []})]}, renderer)
    assert cli.main(["view", str(path)]) == 0
    page = tmp_path / "eval.replies.html"
    assert capsys.readouterr().out.strip() == str(page)
    data = view.page_data(path)
    assert data["run"] == "eval.replies.jsonl" and data["steps"][0]["label"] == "base"
    assert "multi_turn:force_terminated" in page.read_text()
    assert cli.main(["view", str(tmp_path / "missing.replies.jsonl")]) == 2
    assert capsys.readouterr().err.endswith("missing.replies.jsonl is not a directory: give a run directory "
                                            "(run.run_dir of a training config) or an evaluation's replies "
                                            "(.replies.jsonl)\n")


def test_a_file_that_holds_no_replies_is_one_line(tmp_path):
    empty = tmp_path / "x.replies.jsonl"
    empty.write_text('{"torn": \n')
    with pytest.raises(ValueError, match=r"^no replies in .*x\.replies\.jsonl$"):
        read_replies(empty)
