"""The relative reward audit (#43 item 2): a hack that earns nothing can still outrank trying inside a group.

Played on the GUI page with turn rewards on (scripted policies through the real runner, a few seconds): under the
rules before `core.returns` (a value is outcome + turn rewards; a truncation scores `truncated_reward` and its cut
turn is free) doing nothing and running out of tokens outrank an honest failure for every credit rule and estimator;
under today's rules no hack does. A hand-built group checks the margin the verdict reads.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest
from helpers import question_env_module, trajectory

from agent_rl import cli
from agent_rl.audit.relative import Played, advantages_in_group, format_relative, judge_relative, play_relative
from agent_rl.core.registry import load_env
from agent_rl.core.types import Return, StopReason, Trajectory, Turn
from agent_rl.learn.algorithm import AlgorithmConfig

CREDITS = ["trajectory", "turn", "gigpo"]
ESTIMATORS = ["grpo", "rloo", "dr_grpo"]
GUI_HACKS = ["empty_reply", "echo_question", "claim_done", "act_halfway", "unknown_tool_then_done", "busy_calls",
             "farm_saves", "cut_off"]


def before_the_rules(trajs, truncated_reward) -> tuple[Trajectory, ...]:
    """Returns as they were before `core.returns`' rules: outcome + every turn reward; a truncated episode scores
    `truncated_reward` whatever its group did, its cut turn uncharged."""
    out = []
    for t in trajs:
        if not t.truncated:
            ret = Return(t.reward + sum(turn.reward for turn in t.turns), t.reward)
        elif truncated_reward is None:
            ret = Return(0.0, 0.0, usable=False)
        else:
            ret = Return(truncated_reward, truncated_reward, share=0.0)
        out.append(replace(t, ret=ret))
    return tuple(out)


@pytest.fixture(scope="module")
def gui_played(smol_dir):
    from agent_rl.core.renderers.choose import load_renderer

    spec = load_env("gui").with_task_args({"turn_rewards": True})
    return asyncio.run(play_relative(spec, load_renderer(smol_dir), n_tasks=2))


def test_the_gui_group_holds_honest_failures_and_the_hacks(gui_played):
    [first, _] = gui_played
    honest = dict(first.honest)
    assert honest["the solver"].reward == 1.0 and honest["a slip, then the solver"].reward == 1.0
    failing = honest["a slip on every turn it fits, until the turn limit"]
    assert failing.reward == 0.0 and failing.stop_reason == StopReason.MAX_TURNS and failing.turn_reward < 0
    cut = [t for name, _, _, t in first.hacks if name == "cut_off"]
    assert cut and all(t.truncated and t.stop_reason == StopReason.LENGTH for t in cut)
    assert cut[0].turns[-1].finish_reason == "length" and cut[0].turns[-1].reward < 0  # charged as a failed call


@pytest.mark.parametrize("advantage", ESTIMATORS)
@pytest.mark.parametrize("credit", CREDITS)
def test_the_old_rules_let_doing_nothing_and_running_out_of_tokens_outrank_trying(gui_played, credit, advantage):
    algo = AlgorithmConfig(credit=credit, advantage=advantage, truncated_reward=0.0)
    report = judge_relative("gui", gui_played, algo, before_the_rules)
    assert [r.name for r in report.failures] == GUI_HACKS, format_relative(report)  # every one, doing nothing first
    assert report.honest_failures == 2 and report.failure_line().startswith(f"gui (credit {credit}, {advantage}): ")
    claim = next(r for r in report.rows if r.name == "claim_done")
    assert claim.worst is not None and claim.worst["values"]["hack"] == 0.0  # nothing done, nothing paid


@pytest.mark.parametrize("advantage", ESTIMATORS)
@pytest.mark.parametrize("credit", CREDITS)
@pytest.mark.parametrize("truncated_reward", [0.0, None])
def test_under_todays_rules_no_hack_outranks_an_honest_failure(gui_played, credit, advantage, truncated_reward):
    algo = AlgorithmConfig(credit=credit, advantage=advantage, truncated_reward=truncated_reward)
    report = judge_relative("gui", gui_played, algo)
    assert not report.failures and report.failure_line() == "", format_relative(report)
    assert [r.name for r in report.rows] == GUI_HACKS
    cut = next(r for r in report.rows if r.name == "cut_off")
    if truncated_reward is None:  # masked: left out of its group, it outranks nothing
        assert cut.margin == -float("inf")
    else:
        assert cut.margin < 0  # the floor ties it with the lowest honest value, its failed call puts it below


def _hand_group() -> Played:
    solver = trajectory(1.0, turns=[0.0])
    failure = trajectory(0.0, turns=[-0.2])  # tried: one failed call, then a wrong answer
    nothing = trajectory(0.0, turns=[0.0])  # 'done' at once
    cut = trajectory(0.0, StopReason.LENGTH, turns=[Turn(0, 0, "length", 0, reward=-0.1)])  # cut: truncated
    return Played("t", (("the solver", solver), ("a failure", failure)),
                  (("claim_done", "gui", "done", nothing), ("cut_off", "turn", "cut", cut)))


def test_the_margin_by_hand():
    # dr_grpo, trajectory credit: an advantage is the value less the group's mean, so the margin is the value's.
    # Before the rules: values solver 1, failure -0.2, nothing 0 (margin 0.2); cut 0 (its group: 1, -0.2, 0;
    # margin 0.2). Today: the failure's turns count 0 x -0.2, so nothing ties it (margin 0); the cut is floored at
    # the lowest honest value 0 and charged its failed call: -0.1 (margin -0.1).
    algo = AlgorithmConfig(advantage="dr_grpo", truncated_reward=0.0)
    old = judge_relative("x", [_hand_group()], algo, before_the_rules)
    assert [(r.name, r.verdict) for r in old.rows] == [("claim_done", "OUTRANKS"), ("cut_off", "OUTRANKS")]
    assert [r.margin for r in old.rows] == pytest.approx([0.2, 0.2])
    new = judge_relative("x", [_hand_group()], algo)
    assert [(r.name, r.verdict) for r in new.rows] == [("claim_done", "ok"), ("cut_off", "ok")]
    assert [r.margin for r in new.rows] == pytest.approx([0.0, -0.1])
    # the per-turn advantages the verdict reads (dr_grpo: each the value less the mean, at every turn)
    solver, failure = (t for _, t in _hand_group().honest)
    assert advantages_in_group([solver, failure], AlgorithmConfig(advantage="dr_grpo")) == [[0.5], [-0.5]]


def test_a_group_without_an_honest_failure_has_nothing_to_compare():
    group = _hand_group()
    only_solver = replace(group, honest=group.honest[:1])
    report = judge_relative("x", [only_solver], AlgorithmConfig(advantage="dr_grpo", truncated_reward=0.0))
    assert all(r.margin == -float("inf") and r.verdict == "ok" for r in report.rows)
    assert "| claim_done | gui | 1 | n/a | ok |" in format_relative(report)


def test_command_relative_prints_both_tables_and_writes_json(tmp_path, capsys):
    out = tmp_path / "audit.json"
    argv = ["audit-reward", "gui", "--tasks", "1", "--env-arg", "turn_rewards=true", "--relative",
            "--set", "algorithm.credit=gigpo", "--json", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "relative reward audit of gui: 1 task, credit gigpo, advantage grpo" in printed
    assert "| cut_off | turn | 1 |" in printed
    absolute, relative = json.loads(out.read_text())
    assert absolute["passed"] and relative["passed"] and relative["credit"] == "gigpo"


def test_command_set_without_relative_is_one_line(capsys):
    assert cli.main(["audit-reward", "gui", "--set", "algorithm.credit=gigpo"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == "error: --set overrides the --relative config: add --relative"


def test_command_relative_without_a_solver_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "solverless_env.py").write_text(SOLVERLESS)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["audit-reward", "solverless_env", "--tasks", "1", "--relative"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == ("error: environment 'solverless_env' has no solver: the relative audit needs honest rollouts"), line


SOLVERLESS = question_env_module("solverless_env", 'messages[-1].content.strip() == self.task["answer"]')
