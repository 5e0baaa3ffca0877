"""coding_tests: visible tests the agent runs, hidden ones that grade; the split, the tool's report, the
reward, a whole multi-turn episode with the scripted sampler, and the real sandbox."""

from __future__ import annotations

import pytest

from agent_rl.core.types import Message, ToolCall
from agent_rl.envs.coding import humaneval_dataset
from agent_rl.envs.coding_tests import CodingTestsEnv, load_tasks, named, report, solve, split_tests
from agent_rl.rewards.code import CheckOutcome, split_check
from agent_rl.rollout.runner import EpisodeLimits, run_episode
from agent_rl.tools.sandbox_bwrap import unavailable_reason

needs_bwrap = pytest.mark.skipif(unavailable_reason() is not None, reason=f"no bubblewrap: {unavailable_reason()}")
LIMITS = EpisodeLimits(max_turns=5, max_tokens_per_turn=1024, max_total_tokens=6144)
TASKS = {t["id"]: t for split in ("train", "eval") for t in load_tasks(1000, split=split)}
TRUNCATE = TASKS["HumanEval/2"]  # check: candidate(3.5) == 0.5; |c(1.33) - 0.33| < 1e-6; |c(123.456) - 0.456| < 1e-6


def test_split_shows_a_third_and_hides_the_rest_disjointly():
    # HumanEval/2: 3 tests -> 1 visible, 2 hidden
    visible, hidden, shown = split_tests(TRUNCATE["test"])
    assert shown == ["assert candidate(3.5) == 0.5"]
    assert [s.source for s in split_check(visible)[1]] == ["assert candidate(3.5) == 0.5"]
    assert [s.source for s in split_check(hidden)[1]] == ["assert abs(candidate(1.33) - 0.33) < 1e-06",
                                                          "assert abs(candidate(123.456) - 0.456) < 1e-06"]
    # HumanEval/83: 5 tests and two `assert True` lines (setup): 2 shown, 3 hidden, the setup in both
    _, steps = split_check(TASKS["HumanEval/83"]["test"])
    visible, hidden, shown = split_tests(TASKS["HumanEval/83"]["test"])
    assert shown == ["assert candidate(1) == 1", "assert candidate(2) == 18"]
    assert [s.source for s in split_check(hidden)[1]] == ["assert True, 'This prints if this assert fails 1 (good for "
                                                          "debugging!)'", "assert candidate(3) == 180",
                                                          "assert candidate(4) == 1800", "assert candidate(5) == 18000",
                                                          steps[-1].source]
    # at most three are shown (a check of 10 tests shows 3); a single looped test cannot be split
    ten = next(r for r in humaneval_dataset() if sum(s.is_test for s in split_check(r["test"])[1]) == 10)
    assert len(split_tests(ten["test"])[2]) == 3
    with pytest.raises(ValueError, match="check has 1 test statement"):
        split_tests(next(r for r in humaneval_dataset() if r["id"] == "HumanEval/32")["test"])


def test_tasks_and_splits():
    train, evals = load_tasks(1000), load_tasks(1000, split="eval")
    assert (len(train), len(evals)) == (134, 26) and not {t["id"] for t in train} & {t["id"] for t in evals}
    assert {"HumanEval/32", "HumanEval/34", "HumanEval/38", "HumanEval/50"}.isdisjoint(TASKS)
    assert [t["id"] for t in load_tasks(4, seed=3)] == [t["id"] for t in load_tasks(4, seed=3)]
    assert named("assert candidate(3.5) == 0.5", "truncate_number") == "assert truncate_number(3.5) == 0.5"
    with pytest.raises(ValueError, match="coding_tests split must be 'train' or 'eval', got 'test'"):
        load_tasks(1, split="test")


def test_the_report_the_agent_reads():
    shown = ["assert f(1) == 2", "assert f(2) == 3", "assert f(3) == 4"]
    outcomes = [CheckOutcome("assert candidate(1) == 2", "ok"),
                CheckOutcome("assert candidate(2) == 3", "error", "returned 7"),
                CheckOutcome("assert candidate(3) == 4", "timeout", "timed out (over its CPU or wall-clock limit)")]
    assert report(outcomes, shown) == ("1 of 3 visible tests passed.\npassed: assert f(1) == 2\n"
                                       "FAILED: assert f(2) == 3\n  returned 7\n"
                                       "FAILED: assert f(3) == 4\n  timed out (over its CPU or wall-clock limit)")
    assert report(outcomes[:1], shown).endswith("NOT RUN: assert f(2) == 3\nNOT RUN: assert f(3) == 4")
    assert report([CheckOutcome("load", "error", "SyntaxError: invalid syntax (<submission>, line 1)")], shown) == (
        "Your code did not load: SyntaxError: invalid syntax (<submission>, line 1). No test ran.")


@needs_bwrap
async def test_run_tests_fix_then_submit_earns_full_reward(scripted, renderer):
    """A wrong first try, the failure read, a fix tested again, the submission: reward 1."""
    wrong = "def truncate_number(number):\n    return number - 1\n"
    right = "def truncate_number(number):\n    return number % 1.0\n"
    calls = [ToolCall("run_tests", {"code": wrong}), ToolCall("run_tests", {"code": right})]

    def agent(messages):
        done = sum(m.role == "tool" for m in messages)
        if done < 2:
            return Message("assistant", "Testing.", (calls[done],))
        return Message("assistant", f"```python\n{right}```")

    async with CodingTestsEnv(TRUNCATE) as env:
        prompt = (await env.initial_messages())[1].content
        traj = await run_episode(env, scripted(agent, on_messages=True), renderer, LIMITS, TRUNCATE["id"])
    assert "assert truncate_number(3.5) == 0.5" in prompt and "1.33" not in prompt  # hidden tests stay hidden
    tools = [m.content for m in traj.messages if m.role == "tool"]
    assert tools == ["0 of 1 visible tests passed.\nFAILED: assert truncate_number(3.5) == 0.5\n  returned 2.5",
                     "1 of 1 visible tests passed.\npassed: assert truncate_number(3.5) == 0.5"]
    assert traj.reward == 1.0 and len(traj.turns) == 3
    assert traj.reward_parts == {"solved": 1.0, "tests_passed": 1.0, "submitted": 1.0, "compiled": 1.0,
                                 "ran_tests": 1.0, "test_runs": 2.0, "revised_after_failure": 1.0}


@needs_bwrap
async def test_partial_direct_and_missing_submissions(scripted, renderer):
    # passes the visible test and one of the two hidden ones: 0.5 x 0 + 0.5 x 1/2
    half = "def truncate_number(number):\n    return 0.5 if number == 3.5 else round(number % 1.0, 2)\n"
    async with CodingTestsEnv(TRUNCATE) as env:
        traj = await run_episode(env, scripted(lambda p: f"```python\n{half}```"), renderer,
                                 LIMITS, TRUNCATE["id"])
    assert traj.reward == pytest.approx(0.25)
    assert traj.reward_parts == {"solved": 0.0, "tests_passed": 0.5, "submitted": 1.0, "compiled": 1.0,
                                 "ran_tests": 0.0, "test_runs": 0.0, "revised_after_failure": 0.0}
    # the solver, direct: full reward without a test run; a reply without code, or cut while calling: 0
    async with CodingTestsEnv(TRUNCATE) as env:
        traj = await run_episode(env, scripted(lambda m: solve(TRUNCATE, m, True), on_messages=True),
                                 renderer, LIMITS, TRUNCATE["id"])
    assert traj.reward == 1.0 and traj.reward_parts["ran_tests"] == 0.0
    call = ToolCall("run_tests", {"code": half})
    for agent, turns in ((lambda m: Message("assistant", "It returns the fraction."), 1),
                         (lambda m: Message("assistant", f"```python\n{half}```", (call,)), 2)):
        async with CodingTestsEnv(TRUNCATE) as env:
            traj = await run_episode(env, scripted(agent, on_messages=True), renderer,
                                     EpisodeLimits(max_turns=turns, max_tokens_per_turn=1024,
                                                   max_total_tokens=6144), TRUNCATE["id"])
        assert traj.reward == 0.0 and traj.reward_parts["submitted"] == 0.0, traj.reward_parts


@needs_bwrap
async def test_the_tool_says_why_code_fails_to_load_or_times_out():
    async with CodingTestsEnv(TRUNCATE) as env:
        broken = await env.run_tests("def truncate_number(number) return 1")
        loops = await env.run_tests("def truncate_number(number):\n    while True:\n        pass\n")
        raises = await env.run_tests("def truncate_number(number):\n    return 1 / 0\n")
    assert broken == ("Your code did not load: SyntaxError: expected ':' (<submission>, line 1). No test ran.")
    assert loops == ("0 of 1 visible tests passed.\nFAILED: assert truncate_number(3.5) == 0.5\n"
                     "  timed out (over its CPU or wall-clock limit)")
    assert raises.endswith("  raised ZeroDivisionError: division by zero")
    assert env.test_runs == 3
    # three failed runs, each followed by other code: the test-fix loop, as the reward's metric counts it
    assert [ok for _, ok in env.runs] == [False, False, False]


@needs_bwrap
async def test_a_failed_run_followed_by_the_same_code_is_no_revision():
    """`revised_after_failure`: a failing run then the same code submitted is not a fix; a passing run then other
    code is not one either; a failing run then other code is."""
    wrong = "def truncate_number(number):\n    return number - 1\n"
    right = "def truncate_number(number):\n    return number % 1.0\n"
    for runs, submitted, revised in (([wrong], wrong, 0.0), ([right], wrong, 0.0), ([wrong], right, 1.0),
                                     ([wrong, right], right, 1.0)):
        async with CodingTestsEnv(TRUNCATE) as env:
            for code in runs:
                await env.run_tests(code)
            reward = await env.reward([Message("assistant", f"```python\n{submitted}```")])
        assert reward.parts["revised_after_failure"] == revised, (runs, submitted)
