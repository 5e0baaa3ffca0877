"""Rollout traces and `agent-rl view`: what a step writes, which groups it keeps, resume, the page.

Trajectories are real ones, played by the episode runner with the real SmolLM2 renderer and a
scripted sampler; advantages come from the real `group_advantages`. The page is checked as a file
here, and in a real headless Chromium in tests/test_trace_page.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from helpers import ADD_CALL, HOSTILE, PLAN, trajectory

from agent_rl import cli
from agent_rl.core.types import Segment, StopReason, TrajectoryGroup
from agent_rl.learn.advantages import group_advantages, grpo_advantages
from agent_rl.runs import traces, view
from agent_rl.runs.display import mask_runs


def test_mask_runs_by_hand():
    runs = mask_runs([5, 6, 7, 8, 9], [0, 0, 1, 1, 0], [0.0, 0.0, -1.0, -0.5, 0.0])
    assert [(r.sampled, r.start, r.token_ids) for r in runs] == \
        [(False, 0, (5, 6)), (True, 2, (7, 8)), (False, 4, (9,))]
    assert runs[1].mean_logprob == -0.75
    # a weight push in the middle of a turn cuts its sampled run in two, each with its version
    runs = mask_runs([5, 6, 7, 8, 9], [0, 1, 1, 1, 0], [0.0, -1.0, -1.0, -0.5, 0.0], [-1, 3, 3, 4, -1])
    assert [(r.sampled, r.start, r.token_ids, r.version) for r in runs] == \
        [(False, 0, (5,), -1), (True, 1, (6, 7), 3), (True, 3, (8,), 4), (False, 4, (9,), -1)]


def _group(task: str, stops: list[StopReason]) -> TrajectoryGroup:
    return TrajectoryGroup(task, tuple(trajectory(stop=s, task_id=task) for s in stops))


def test_pick_groups_keeps_failures_and_spreads_the_rest_by_hand():
    ok, cut, err = StopReason.NO_TOOL_CALL, StopReason.LENGTH, StopReason.ERROR
    clean = [_group(f"g{i}", [ok, ok]) for i in range(8)]
    assert traces.pick_groups(clean, 2) == [2, 6]  # the middles of two halves of 8
    assert traces.pick_groups(clean, 0) == [] and traces.pick_groups(clean, 20) == list(range(8))
    mixed = list(clean)
    mixed[1], mixed[5] = _group("g1", [ok, cut]), _group("g5", [err, ok])
    # half (1 of 2) a failing group: the middle one of [1, 5]; the other the middle one of [0, 2, 3, 4, 6, 7]
    assert traces.pick_groups(mixed, 2) == [4, 5]
    assert traces.pick_groups(mixed, 1) == [5]  # one kept: a failing one
    assert traces.pick_groups(mixed, 4) == [1, 2, 5, 6]
    assert traces.pick_groups(mixed[:2], 2) == [0, 1]  # too few clean groups: failing ones fill in
    assert traces.pick_groups(mixed, 3) == traces.pick_groups(list(mixed), 3)  # a function of the groups only


async def test_write_step_records_the_trajectories_as_trained(tmp_path, play_plan, renderer):
    groups = await play_plan(PLAN)
    adv = group_advantages(groups, grpo_advantages)
    path = traces.write_step(tmp_path, 3, groups, adv, renderer, keep_groups=4)
    assert path == tmp_path / "traces" / "step-000003.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["task_id"], r["group"], r["index"]) for r in records] == \
        [(t, g, i) for g, t in enumerate(PLAN) for i in range(3)]
    by = {(r["task_id"], r["index"]): r for r in records}
    trajs = {(t.task_id, i): t for g in groups for i, t in enumerate(g.trajectories)}
    for key, r in by.items():  # the tokens exactly as trained, and their text run by run
        t = trajs[key]
        [seg] = r["segments"]
        assert seg["token_ids"] == list(t.token_ids) and seg["loss_mask"] == list(t.loss_mask)
        assert "".join(run["text"] for run in seg["runs"]) == renderer.render_text(t.token_ids)
        assert r["num_sampled"] == t.num_sampled and r["step"] == 3 and r["groups"] == 4 and r["group_size"] == 3
    learn = by["t-learn", 0]
    # the advantages the batch got (GRPO, rewards 1, 0, 0: (1 - 1/3) / (std 0.5774 + eps)); t-flat did not train,
    # the crash and the truncated episode were left out of their groups
    assert adv.trajectories[:3] == groups[0].trajectories and len(adv.trajectories) == 3 + 2 + 2
    assert learn["reward"] == 1.0 and \
        learn["advantage"] == adv.advantages[0] == pytest.approx(2 / 3 / 0.57735, abs=1e-4)
    assert by["t-learn", 1]["advantage"] == adv.advantages[1] < 0 and learn["dropped"] is None
    assert [m["role"] for m in learn["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert learn["messages"][2]["tool_calls"] == \
        [{"name": "add", "arguments": {"a": 2, "b": 3}, "id": "call_1", "error": None}]
    assert learn["messages"][3]["content"] == "5" and learn["tool_calls"][0]["ok"] is True
    assert [t["finish_reason"] for t in learn["turns"]] == ["stop", "stop"]
    assert [t["versions"] for t in learn["turns"]] == [[0], [0]] and learn["policy_version"] == 0
    sampled = [run for run in learn["segments"][0]["runs"] if run["sampled"]]
    assert [run["text"] for run in sampled] == [ADD_CALL + "<|im_end|>", "It is 5.<|im_end|>"]
    assert all(run["mean_logprob"] == -0.5 for run in sampled)
    assert by["t-flat", 0]["advantage"] is None and "without reward variance" in by["t-flat", 0]["dropped"]
    bad, crashed = by["t-crash", 0], by["t-crash", 1]
    assert bad["tool_calls"][0]["ok"] is False and bad["messages"][2]["tool_calls"][0]["error"]
    assert crashed["stop_reason"] == "error" and crashed["error"] == "RuntimeError: sampler went away"
    assert crashed["advantage"] is None and crashed["dropped"].startswith("infrastructure error")
    cut = by["t-cut", 0]
    assert cut["truncated"] and cut["stop_reason"] == "length" and cut["turns"][0]["finish_reason"] == "length"
    assert cut["advantage"] is None and cut["dropped"] == "truncated: masked out of the loss"  # its group trained
    assert by["t-cut", 1]["messages"][-1]["content"] == HOSTILE


async def test_a_turn_split_by_a_weight_push_shows_both_versions(play_plan, renderer):
    """The first turn's first 5 tokens by version 3, the rest by 4 (a push aborted and continued it), the
    second turn by 4: the record lists both versions for the first turn, and its sampled text in two runs."""
    [group] = await play_plan({"t": ["tool_then_right"]})
    traj = group.trajectories[0]
    first, second = traj.turns
    versions = list(traj.versions)
    versions[first.start:first.end] = [3] * 5 + [4] * (first.end - first.start - 5)
    versions[second.start:second.end] = [4] * (second.end - second.start)
    traj = replace(traj, versions=tuple(versions), turns=(replace(first, policy_version=3),
                                                         replace(second, policy_version=4)), policy_version=3)
    record = traces.trace_record(traj, renderer)
    assert [t["versions"] for t in record["turns"]] == [[3, 4], [4]]
    [seg] = record["segments"]
    assert seg["versions"] == versions
    sampled = [(run["version"], run["n"]) for run in seg["runs"] if run["sampled"]]
    assert sampled == [(3, 5), (4, first.end - first.start - 5), (4, second.end - second.start)]


async def test_traces_off_and_a_sample_per_step(tmp_path, play_plan, renderer):
    groups = await play_plan(PLAN)
    adv = group_advantages(groups, grpo_advantages)
    assert traces.write_step(tmp_path, 1, groups, adv, renderer, keep_groups=0) is None
    assert not (tmp_path / "traces").exists()
    path = traces.write_step(tmp_path, 1, groups, adv, renderer, keep_groups=2)
    kept = {json.loads(line)["task_id"] for line in path.read_text().splitlines()}
    assert kept == {"t-flat", "t-cut"}  # one failing group (of t-crash, t-cut), one clean (of t-learn, t-flat)


async def test_earlier_segments_are_listed_before_the_trajectory_tokens(play_plan, renderer):
    [group] = await play_plan({"t": ["wrong"]})
    traj = group.trajectories[0]
    closed = Segment(token_ids=(1, 9690, 198), loss_mask=(0, 0, 0), logprobs=(0.0, 0.0, 0.0))
    object.__setattr__(traj, "segments", (closed,))  # an earlier, closed segment (an edited history)
    record = traces.trace_record(traj, renderer)
    assert [s["token_ids"] for s in record["segments"]] == [[1, 9690, 198], list(traj.token_ids)]
    assert record["segments"][0]["runs"] == [{"sampled": False, "start": 0, "n": 3, "text": "<|im_start|>system\n",
                                              "mean_logprob": None, "version": None}]
    assert record["segments"][0]["versions"] == [-1, -1, -1]
    assert record["num_tokens"] == 3 + len(traj.token_ids) and record["num_sampled"] == traj.num_sampled


async def test_resume_drops_later_steps_and_reading_skips_a_torn_line(tmp_path, play_plan, renderer):
    groups = await play_plan({"t-learn": PLAN["t-learn"]})
    adv = group_advantages(groups, grpo_advantages)
    for step in (1, 2, 3, 4):
        traces.write_step(tmp_path, step, groups, adv, renderer, keep_groups=1)
    assert traces.truncate_after(tmp_path, 2) == 2
    assert sorted(traces.read_traces(tmp_path)) == [1, 2]
    with open(traces.step_file(tmp_path, 2), "a") as f:
        f.write('{"step": 2, "task_id": "torn')
    assert len(traces.read_traces(tmp_path)[2]) == 3  # the group of 3, not the torn line
    assert sorted(traces.read_traces(tmp_path, {2, 7})) == [2]
    assert traces.truncate_after(tmp_path, 0) == 0 and not traces.step_file(tmp_path, 1).exists()


def test_spans():
    assert traces.spans([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10" and traces.spans([4]) == "4" and traces.spans([]) == ""


def test_read_traces_names_what_is_missing(tmp_path):
    with pytest.raises(traces.TraceError, match="is not a directory"):
        traces.read_traces(tmp_path / "nope")
    with pytest.raises(traces.TraceError, match=r"no traces in .*run.trace_groups was 0"):
        traces.read_traces(tmp_path)


def test_parse_steps():
    assert view.parse_steps("1-3,7") == {1, 2, 3, 7} and view.parse_steps(None) is None
    for bad in ("x", "3-1", "0", "2-"):
        with pytest.raises(ValueError, match="--steps"):
            view.parse_steps(bad)


def embedded(page: str) -> dict:
    block = re.search(r'<script id="trace-data" type="application/json">(.*?)</script>', page, re.DOTALL)
    return json.loads(block.group(1))


async def test_page_embeds_the_traces_and_model_text_cannot_close_its_script(tmp_path, play_plan, renderer):
    groups = await play_plan(PLAN)
    adv = group_advantages(groups, grpo_advantages)
    for step in (1, 2):
        traces.write_step(tmp_path, step, groups, adv, renderer, keep_groups=4)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.25, "lr": 1}\n')
    page = view.build_page(tmp_path)
    assert "__DATA__" not in page and "window.__pwned" not in page.split('id="trace-data"')[0]
    assert page.count("</script>") == 2 and "<img" not in page  # the data's `<`, `>` are escaped
    data = embedded(page)
    assert [s["step"] for s in data["steps"]] == [1, 2] and data["steps"][0]["metrics"] == {"reward_mean": 0.25}
    hostile = next(r for r in data["steps"][0]["trajectories"] if r["task_id"] == "t-cut" and r["index"] == 1)
    assert hostile["messages"][-1]["content"] == HOSTILE and set(hostile["segments"][0]) == {"runs"}
    assert "http" not in page.split("<script")[0].replace('http-equiv="Content-Security-Policy"', "")


async def test_view_command_writes_the_page_and_bad_input_is_one_line(tmp_path, play_plan, renderer, capsys):
    groups = await play_plan({"t-learn": PLAN["t-learn"]})
    traces.write_step(tmp_path, 1, groups, group_advantages(groups), renderer, keep_groups=1)
    assert cli.main(["view", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "traces.html")
    assert embedded((tmp_path / "traces.html").read_text())["steps"][0]["step"] == 1
    assert cli.main(["view", str(tmp_path), "--out", str(tmp_path / "p.html"), "--steps", "1"]) == 0
    assert (tmp_path / "p.html").is_file()
    for argv, problem in ([str(tmp_path / "missing")], "is not a directory"), \
            ([str(tmp_path / "traces")], "no traces"), \
            ([str(tmp_path), "--steps", "5"], "traced steps: 1"), ([str(tmp_path), "--steps", "x"], "--steps"):
        capsys.readouterr()
        assert cli.main(["view", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and problem in err and err.count("\n") == 1, err
