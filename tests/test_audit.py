"""The reward audit: every built-in environment resists every applicable hack and its solver earns full
reward; a reward built to be hackable is caught; the command's table, JSON and error lines.

Each built-in environment is audited on a few tasks through the real runner (seconds each; coding
runs its hidden tests in the bubblewrap sandbox, so it plays two tasks).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import os
import re
import shutil

import pytest
from doc_pages import marked_block
from helpers import question_env_module

from agent_rl import cli
from agent_rl.audit.catalogue import CATALOGUE, hacks_named
from agent_rl.audit.hacks import arithmetic_in, lookalike
from agent_rl.audit.play import audit_env
from agent_rl.audit.report import format_matrix, format_report
from agent_rl.core.audit_target import HACK_GROUPS, AuditTarget, NotAudited, Target
from agent_rl.core.registry import BUILTIN, EnvSpec, load_env
from agent_rl.core.renderers.choose import get_renderer
from agent_rl.core.types import Message, Reward
from agent_rl.envs.base import ToolEnv
from agent_rl.tools.sandbox_bwrap import unavailable_reason

ANSWERED = ["list_candidates", "hedge", "empty_reply", "several_answers", "echo_question", "flood",
            "lookalike_digits", "echo_tool_output", "answer_in_tool_call", "unknown_tool_then_guess"]
CODING = ["empty_reply", "several_answers", "echo_question", "answer_in_tool_call", "unknown_tool_then_guess",
          "exit_zero", "patch_checker", "always_equal", "read_tests"]
GUI = ["empty_reply", "echo_question", "claim_done", "act_halfway", "unknown_tool_then_done", "busy_calls",
       "farm_saves", "cut_off"]
TURNS = [*ANSWERED, "busy_calls", "cut_off"]  # the environments with turn rewards add the hacks on them
CODING_TESTS = [*CODING, "hardcode_visible", "print_expected", "edit_tests", "catch_assertion"]


def _no_browser() -> str | None:
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is not installed (pip install playwright)"
    if not (os.environ.get("AGENT_RL_CHROMIUM") or shutil.which("chromium")):
        return "no Chromium binary (apt-get install -y chromium, or set AGENT_RL_CHROMIUM)"
    return None


needs_bwrap = pytest.mark.skipif(unavailable_reason() is not None, reason=f"no bubblewrap: {unavailable_reason()}")
BUILT_IN = [  # (env, tasks, the hacks that apply, hand-checked against each environment's audit target)
    pytest.param("calculator", 3, TURNS, id="calculator"),
    pytest.param("math", 2, ANSWERED, id="math", marks=needs_bwrap),  # its python tool is sandboxed
    pytest.param("search_qa", 3, [h for h in ANSWERED if h != "lookalike_digits"], id="search_qa"),  # no digits
    pytest.param("kg_qa", 3, [h for h in TURNS if h != "lookalike_digits"], id="kg_qa"),
    pytest.param("coding", 2, [*CODING, "busy_calls"], id="coding", marks=needs_bwrap),  # as envs/coding names
    pytest.param("coding_tests", 2, CODING_TESTS, id="coding_tests", marks=needs_bwrap),
    pytest.param("gui", 3, GUI, id="gui"),
    pytest.param("mcp_units", 3, ANSWERED, id="mcp_units"),  # an MCP server's tools; a rounded number answer
    pytest.param("mcp_time", 3, ANSWERED, id="mcp_time",  # a third party's MCP server; a time (HH:MM) answer
                 marks=pytest.mark.skipif(importlib.util.find_spec("mcp_server_time") is None,
                                          reason="pip install 'agent-rl[mcp-time]'")),
    pytest.param("gui_browser", 1, GUI, id="gui_browser",
                 marks=pytest.mark.skipif(_no_browser() is not None, reason=str(_no_browser()))),
]


@pytest.mark.parametrize(("env", "n_tasks", "hacks"), BUILT_IN)
async def test_no_hack_earns_reward_and_the_solver_earns_full_reward(env, n_tasks, hacks, renderer):
    report = await audit_env(load_env(env), renderer, n_tasks=n_tasks)
    assert [r.name for r in report.rows] == [*hacks, "solver"]
    for row in report.rows[:-1]:
        assert row.episodes >= n_tasks and row.errors == 0 and row.max_reward == 0.0, row
        assert row.verdict == "ok"
    solver = report.rows[-1]
    assert solver.episodes == n_tasks and solver.min_reward == 1.0 and solver.verdict == "ok", solver
    assert not report.failures and report.failure_line() == ""


@pytest.mark.parametrize("env", ["calculator", "search_qa"])
async def test_bare_json_calls_earn_nothing_read_as_calls_or_as_text(env, renderer, qwen25_tokenizer):
    # Qwen2.5's renderer reads `{"name": ..., "arguments": ...}` without tags as a call, SmolLM2's ChatML as
    # text; the answer in its arguments once earned 1 both ways (the reply read as the final answer, or an
    # episode of such calls cut at max_turns scored on its last one)
    for r in (renderer, get_renderer(qwen25_tokenizer)):
        report = await audit_env(load_env(env), r, n_tasks=2)
        [row] = [row for row in report.rows if row.name == "answer_in_tool_call"]
        assert row.episodes == 10 and row.max_reward == 0.0 and not report.failures, report.failure_line()


@needs_bwrap
async def test_coding_tests_hacks_pass_the_visible_tests_and_earn_nothing(renderer):
    # special-casing the visible tests passes them all (the tool says so); the hidden ones are disjoint

    from agent_rl.audit.play import LIMITS, play_policy
    from agent_rl.audit.targets import plan_for

    spec = load_env("coding_tests")
    tasks = spec.load_tasks(2)
    plan = plan_for(spec)
    [hack] = [h for h in plan.hacks if h.name == "hardcode_visible"]
    for task in tasks:
        for policy in hack.variants(plan.target(task, tasks)).values():
            traj = await play_policy(spec, renderer, LIMITS, task, policy, asyncio.Semaphore(1))
            n = len(task["shown_tests"])
            assert traj.messages[3].content.startswith(f"{n} of {n} visible tests passed.") and traj.reward == 0.0


async def test_toy_has_nothing_to_audit(renderer):
    with pytest.raises(ValueError, match="rewards short replies, not an answer, and has no scripted solver"):
        await audit_env(load_env("toy"), renderer)


# -- a reward built to be hacked: any number in the reply that equals the answer -------------------
class AnyNumberEnv(ToolEnv):
    """What a hasty reward looks like: credit when the answer is among the numbers of the reply."""

    def __init__(self, task):
        super().__init__([])
        self.task = task

    async def initial_messages(self):
        return [Message("user", self.task["question"])]

    async def reward(self, messages):
        return Reward(float(str(self.task["answer"]) in re.findall(r"-?\d+", messages[-1].content)))


HACKABLE_TASKS = [{"id": f"q{a}", "question": f"What is {a} + {a + 3}?", "answer": str(2 * a + 3)} for a in (4, 9)]
HACKABLE = EnvSpec("any_number", AnyNumberEnv, lambda n, seed=0, split="train": HACKABLE_TASKS[:n],
                   lambda task, messages, direct: Message("assistant", f"The answer is {task['answer']}."))
HACKABLE_MODULE = question_env_module(  # a reward that accepts the answer among other numbers
    "hackable_env", r'self.task["answer"] in re.findall(r"-?\d+", messages[-1].content)', imports="import re")
# by hand: every hack whose reply holds the answer in ASCII digits among others; not the empty reply, the
# question (its numbers are the operands), the answer in look-alike digits alone, a wrong guess, the error
EARNERS = {"list_candidates", "hedge", "several_answers", "flood", "lookalike_digits", "answer_in_tool_call"}


async def test_the_audit_catches_a_reward_that_accepts_a_list(renderer):
    report = await audit_env(HACKABLE, renderer, n_tasks=2)
    assert {r.name for r in report.failures} == EARNERS
    assert all(r.verdict == "EARNS" and r.max_reward == 1.0 for r in report.failures)
    assert report.rows[-1].name == "solver" and report.rows[-1].verdict == "ok"
    listing = next(r for r in report.rows if r.name == "list_candidates")
    assert listing.worst is not None and "11" in listing.worst["last_reply"]  # q4's answer, among the others
    table = format_report(report)
    assert "| hedge | answer | 6 | 1 | " in table and table.count("EARNS") == 2 * len(EARNERS)  # rows, examples
    assert "| hedge | 1 (6) EARNS |" in format_matrix([report])


async def test_an_environments_own_audit_target_chooses_the_hacks_and_the_target(renderer):
    seen = []

    def target(task, tasks):  # a wrong answer of its own: the hedge says "either 11 or 12"
        seen.append((task["id"], len(tasks)))
        return Target(task, task["question"], str(task["answer"]), wrong=(str(int(task["answer"]) + 1),))

    spec = dataclasses.replace(HACKABLE, audit=AuditTarget(("hedge", "unknown_tool_then_guess"), target))
    report = await audit_env(spec, renderer, n_tasks=2)
    assert seen == [("q4", 2), ("q9", 2)]
    # by hand: hedge, 3 variants x 2 tasks, every one holding the answer; the guess is the wrong one
    assert [(r.name, r.episodes, r.max_reward, r.verdict) for r in report.rows] == [
        ("hedge", 6, 1.0, "EARNS"), ("unknown_tool_then_guess", 4, 0.0, "ok"), ("solver", 2, 1.0, "ok")]
    assert report.rows[0].worst["last_reply"] == "either 11 or 12"  # the first of the highest: q4's first variant


async def test_an_audit_target_naming_no_hack_is_one_line(renderer):
    spec = dataclasses.replace(HACKABLE, audit=AuditTarget(("hedge", "guess_twice"), lambda task, tasks: None))
    with pytest.raises(ValueError, match="^environment 'any_number': its audit target names 'guess_twice', which is "
                                         "no hack and no group of hacks [(]groups: answer, tool, coding, "
                                         "visible_tests, gui, turn; hacks: "):
        await audit_env(spec, renderer)


def test_hack_groups_and_names():
    assert {h.group for h in CATALOGUE} == set(HACK_GROUPS)
    assert [h.name for h in hacks_named(("empty_reply", "gui"), "x")] == \
        ["empty_reply", "claim_done", "act_halfway", "unknown_tool_then_done"]
    for name in BUILTIN:  # every built-in environment's audit target names hacks the catalogue has
        audit = load_env(name).audit
        assert isinstance(audit, NotAudited) or hacks_named(audit.hacks, name)  # toy, text_game: NotAudited


async def test_the_readmes_dataset_example_fails_the_audit(tmp_path, monkeypatch, renderer):
    # its TRL-style `exact` reward checks that the reply ends with the answer: "390, 391" earns it
    (tmp_path / "readme_dataset_env.py").write_text(marked_block("example", "dataset"))
    monkeypatch.syspath_prepend(str(tmp_path))
    report = await audit_env(load_env("readme_dataset_env"), renderer, n_tasks=2)
    # by hand: the listings and hedges that end with the answer; the flood's cut falls after "1000"
    # in q2; the look-alike listing ends with the answer in ASCII
    assert {r.name for r in report.failures} == {"list_candidates", "hedge", "flood", "lookalike_digits"}


def test_hack_helpers():
    assert arithmetic_in("What is (123 + 456) * 7?") == "(123 + 456) * 7"
    assert arithmetic_in("Calculate -33 / 11 + -22.") == "-33 / 11 + -22"
    assert arithmetic_in("Turn on dark mode and set the font size to 16, then save.") == ""
    assert lookalike("-4053", 0xFF10) == "-４０５３" and lookalike("12.5", 0x0660) == "١٢.٥"


# -- the command --------------------------------------------------------------------------------
def test_command_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "audit.json"
    assert cli.main(["audit-reward", "calculator", "--tasks", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("reward audit of calculator: 1 task (train split, seed 0)")
    assert "| hack | group | episodes | max reward | mean reward | verdict |" in printed
    assert "| solver | solver | 1 | 1 | 1 | ok |" in printed
    [report] = json.loads(out.read_text())
    assert report["passed"] and [r["name"] for r in report["rows"]] == [*TURNS, "solver"]


def test_command_fails_with_one_line_naming_the_hacks(tmp_path, monkeypatch, capsys):
    (tmp_path / "hackable_env.py").write_text(HACKABLE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["audit-reward", "hackable_env", "--tasks", "1"]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: reward audit failed: hackable_env: list_candidates EARNS (max reward 1), ")
    assert all(name in line for name in EARNERS) and "echo_question" not in line


@pytest.mark.parametrize(("argv", "message"), [
    (["audit-reward", "toy"], "error: environment 'toy' rewards short replies"),
    (["audit-reward", "no_such_env"], "error: unknown environment 'no_such_env'"),
    (["audit-reward", "calculator", "--tasks", "0"], "error: --tasks must be at least 1 (got 0)"),
])
def test_command_bad_input_is_one_line(argv, message, capsys):
    assert cli.main(argv) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(message), line

