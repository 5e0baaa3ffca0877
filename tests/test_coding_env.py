"""The coding environment and its hidden-test reward, with the scripted sampler and the real sandbox."""

from __future__ import annotations

import asyncio
import time

import datasets
import pytest

from agent_rl.envs.coding import (
    GRADER_LIMITS,
    CodingEnv,
    check_row,
    humaneval_dataset,
    load_tasks,
    solve,
)
from agent_rl.rewards.code import extract_code, run_hidden_tests, split_check
from agent_rl.rollout.runner import EpisodeLimits, run_episode
from agent_rl.tools.sandbox import Limits, get_backend
from agent_rl.tools.sandbox_bwrap import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=f"no bubblewrap: {unavailable_reason()}")

PROBLEMS = {row["id"]: row for row in humaneval_dataset()}
TRUNCATE = PROBLEMS["HumanEval/2"]  # truncate_number: check has 3 asserts
FAST = Limits(wall_s=5.0, cpu_s=1)  # about 1-2 CPU s per looping test: short, and immune to machine load
LIMITS = EpisodeLimits(max_turns=5, max_tokens_per_turn=1024, max_total_tokens=4096)


async def score(task, code: str, max_timeouts: int = 3):
    return await run_hidden_tests(get_backend(None, FAST), task["prompt"], code, task["entry_point"], task["test"],
                                  max_timeouts)


def test_dataset_and_splits_are_deterministic_and_disjoint():
    assert isinstance(humaneval_dataset(), datasets.Dataset) and len(PROBLEMS) == 164
    train, evals = load_tasks(1000, seed=0), load_tasks(1000, seed=0, split="eval")
    assert len(train) + len(evals) == 164 and not {t["id"] for t in train} & {t["id"] for t in evals}
    assert [t["id"] for t in load_tasks(5, seed=1)] == [t["id"] for t in load_tasks(5, seed=1)]
    assert [t["id"] for t in load_tasks(5, seed=1)] != [t["id"] for t in load_tasks(5, seed=2)]
    assert {t["id"] for t in load_tasks(1000, seed=7, split="eval")} == {t["id"] for t in evals}
    with pytest.raises(ValueError, match="coding split must be 'train' or 'eval', got 'test'"):
        load_tasks(3, split="test")


def test_check_is_split_into_tests_and_setup():
    # HumanEval/83: five asserts on candidate, two `assert True` lines that test nothing
    _, steps = split_check(PROBLEMS["HumanEval/83"]["test"])
    assert [s.is_test for s in steps] == [False, True, True, True, True, True, False]
    assert steps[1].source == "assert candidate(1) == 1"
    # HumanEval/32: imports and a seeded rng are setup, the one loop of asserts is a single test
    preamble, steps = split_check(PROBLEMS["HumanEval/32"]["test"])
    assert preamble == "METADATA = {}"
    assert [s.source for s in steps[:4]] == ["import math", "import random", "rng = random.Random(42)", "import copy"]
    assert [s.is_test for s in steps] == [False, False, False, False, True]


def test_extract_code_takes_the_last_block_outside_tool_calls():
    assert extract_code("a\n```python\nx = 1\n```\nthen\n```py\nx = 2\n```") == "x = 2\n"
    assert extract_code("```\ny = 3\n```") == "y = 3\n"
    assert extract_code('```python\nz = 1\n```<tool_call>\n{"code": "```python\\nw\\n```"}\n</tool_call>') == "z = 1\n"
    assert extract_code("def f(): pass") is None and extract_code("```python\nunclosed") is None


async def test_tool_using_episode_earns_full_reward(scripted, renderer):
    task = PROBLEMS["HumanEval/0"]
    async with CodingEnv(task) as env:
        messages = await env.initial_messages()
        traj = await run_episode(env, scripted(lambda m: solve(task, m, False), on_messages=True),
                                 renderer, LIMITS, task["id"])
    assert "assert candidate" not in "".join(m.content for m in messages)  # hidden tests stay hidden
    assert traj.reward == 1.0, traj.reward_parts
    assert traj.reward_parts == {"tests_passed": 1.0, "submitted": 1.0, "compiled": 1.0, "solved": 1.0}
    assert [c.name for c in traj.tool_calls] == ["python"] and traj.tool_calls[0].ok
    # the docstring's two examples, run by the demonstration: False, True
    assert traj.messages[3].content.startswith("[ok |") and traj.messages[3].content.endswith("stdout:\nFalse\nTrue")


async def test_direct_demonstration_and_no_code_block(scripted, renderer):
    task = PROBLEMS["HumanEval/38"]  # check() assigns `str`: it must not leak into the submission's globals
    async with CodingEnv(task) as env:
        traj = await run_episode(env, scripted(lambda m: solve(task, m, True), on_messages=True),
                                 renderer, LIMITS, task["id"])
    assert traj.reward == 1.0 and traj.tool_calls == ()
    report = await score(task, "def decode_cyclic(s):\n    return str(encode_cyclic(encode_cyclic(s)))\n")
    assert report.share == 1.0
    async with CodingEnv(task) as env:
        traj = await run_episode(env, scripted(lambda p: "I would reverse the cycling."), renderer, LIMITS, task["id"])
    assert traj.reward == 0.0
    assert traj.reward_parts == {"tests_passed": 0.0, "submitted": 0.0, "compiled": 0.0, "solved": 0.0}


async def test_a_partly_wrong_solution_earns_the_exact_share(scripted, renderer):
    # truncate_number's check: candidate(3.5) == 0.5; |c(1.33) - 0.33| < 1e-6; |c(123.456) - 0.456| < 1e-6.
    # Always 0.5 passes the first only: 1/3.
    report = await score(TRUNCATE, "def truncate_number(number):\n    return 0.5\n")
    assert report.statuses == ("ok", "error", "error") and report.share == pytest.approx(1 / 3)
    # HumanEval/83 checks n = 1..5 against 1, 18, 180, 1800, 18000; 18 * 10 ** (n - 2) misses n = 1: 4/5
    task = PROBLEMS["HumanEval/83"]
    reply = "```python\ndef starts_one_ends(n):\n    return 18 * 10 ** (n - 2)\n```"
    async with CodingEnv(task) as env:
        traj = await run_episode(env, scripted(lambda p: reply), renderer, LIMITS, task["id"])
    assert traj.reward == pytest.approx(0.8)
    assert traj.reward_parts == {"tests_passed": pytest.approx(0.8), "submitted": 1.0, "compiled": 1.0, "solved": 0.0}


async def test_loops_floods_and_crashes_score_zero_within_deadlines():
    start = time.monotonic()
    sleeps_on_big = "def truncate_number(x):\n    __import__('time').sleep(60 * (x > 100))\n    return x % 1.0"
    report = await score(TRUNCATE, sleeps_on_big)  # the wall-clock backstop
    assert report.statuses == ("ok", "ok", "timeout") and report.share == pytest.approx(2 / 3)
    busy = "def truncate_number(number):\n    while True:\n        pass\n"
    report = await score(TRUNCATE, busy, max_timeouts=2)  # the CPU deadline
    assert report.statuses == ("timeout", "timeout", "not_run") and report.compiled
    assert time.monotonic() - start < 40  # three CPU deadlines and restarts, with room for a busy machine
    for body in ["    while True:\n        print('x' * 1000)",  # output flood
                 "    import os\n    os._exit(0)",  # the interpreter dies
                 "    raise SystemExit(0)",  # a clean exit is not a pass
                 "    class Yes(float):\n        __eq__ = lambda *a: True\n    return Yes()"]:  # equal to anything
        report = await score(TRUNCATE, "def truncate_number(number):\n" + body + "\n", max_timeouts=1)
        assert report.passed == 0 and report.compiled, (body, report)
    for code in ["def truncate_number(number) return 1", "while True:\n    pass\n", "import sys\nsys.exit(1)\n",
                 "import sys\nsys.exit(0)\n",  # exiting while loading is no program, even with status 0
                 "print('no definition')\n",  # the entry point left as the prompt's bare stub
                 TRUNCATE["prompt"],  # the stub echoed back
                 "def truncate_number(number: float) -> float:\n    return None\n"]:  # a body that does nothing
        report = await score(TRUNCATE, code)
        assert not report.compiled and report.statuses == ("not_run",) * 3, (code, report)


HACKS = {  # each would pass every test if it ran in the tests' interpreter, as it once did
    "patch exec": "import builtins\n_exec = builtins.exec\n"
                  "builtins.exec = lambda src, *a: None if isinstance(src, str) else _exec(src, *a)\n",
    "read the test from the caller's frames":
        "    import sys, ast\n    f = sys._getframe(1)\n"
        "    while f is not None and 'source' not in f.f_locals:\n        f = f.f_back\n"
        "    node = ast.parse(f.f_locals['source']).body[0].test.comparators[0]\n"
        "    return eval(compile(ast.Expression(node), '<t>', 'eval'))\n",
    "return a str that equals anything": "    class S(str):\n        __eq__ = lambda *a: True\n    return S()\n",
    "forge the driver's end marks": "    import os, sys\n    token = sys.modules['__main__']._token\n"
                                    "    os.write(2, b'\\0' + token + b'\\0')\n"
                                    "    os.write(1, b'\\0' + token + b' 0 -\\0')\n    os._exit(0)\n",
}


@pytest.mark.parametrize("hack", HACKS)
async def test_the_submission_cannot_reach_the_tests(hack):
    # the tests call `candidate` in another process, with built-in values only (see rewards.code)
    task = PROBLEMS["HumanEval/53"]  # add(x, y): check's loop of random sums and five fixed asserts
    code = HACKS[hack]
    if code.startswith("    "):  # a function body: the function raises whenever the hack fails
        code = "def add(x, y):\n" + code
    else:
        code += "def add(x, y):\n    raise RuntimeError('no answer')\n"
    report = await score(task, code, max_timeouts=1)
    assert report.passed == 0, report


async def test_the_prompts_helpers_are_the_tests_own():
    # HumanEval/32's check judges find_zero with the prompt's poly(); a submission redefining poly
    # to always say 0 would pass it if the tests read the submission's namespace
    task = PROBLEMS["HumanEval/32"]
    report = await score(task, "def poly(xs, x):\n    return 0\n\ndef find_zero(xs):\n    return 0.0\n")
    assert report.compiled and report.passed == 0, report


async def test_an_endless_submission_through_the_env_is_bounded(scripted, renderer):
    reply = "```python\ndef truncate_number(number):\n    while True:\n        pass\n```"
    start = time.monotonic()
    async with CodingEnv(TRUNCATE, max_timeouts=1) as env:
        traj = await run_episode(env, scripted(lambda p: reply), renderer, LIMITS, TRUNCATE["id"])
    assert traj.reward == 0.0 and traj.reward_parts["compiled"] == 1.0 and traj.error is None
    assert time.monotonic() - start < 30  # one CPU deadline (2-3 s), then the other two tests are not run


async def test_malformed_tool_calls_get_errors_and_the_episode_goes_on(scripted_calls, renderer):
    task = TRUNCATE
    attempts = ['<tool_call>\n{"name": "python", "arguments": {"code": }\n</tool_call>',
                '<tool_call>\n{"name": "run_python", "arguments": {"code": "print(1)"}}\n</tool_call>',
                '<tool_call>\n{"name": "python", "arguments": {"source": "print(1)"}}\n</tool_call>']

    async with CodingEnv(task) as env:
        sampler = scripted_calls(attempts, lambda p: solve(task, [], True))
        traj = await run_episode(env, sampler, renderer, LIMITS, task["id"])
    assert traj.reward == 1.0
    errors = [m.content for m in traj.messages if m.role == "tool"]
    assert errors[0].startswith("Error: tool call 1: malformed JSON")
    assert errors[1] == "Error: unknown tool 'run_python'; available tools: python"
    assert errors[2].startswith("Error: invalid arguments for python: code: Field required")
    assert [c.ok for c in traj.tool_calls] == [False, False, False]


def test_malformed_rows_name_the_row_and_column():
    good = dict(TRUNCATE)
    with pytest.raises(ValueError, match=r"^coding task 'HumanEval/2': column 'test' is missing$"):
        CodingEnv({k: v for k, v in good.items() if k != "test"})
    with pytest.raises(ValueError, match=r"^coding task 'x' \(row 3\): column 'test': test code must define exactly"):
        check_row({**good, "id": "x", "test": "assert True"}, "'x' (row 3)")
    with pytest.raises(ValueError, match=r"^coding task 'HumanEval/2': column 'entry_point' is not a Python name"):
        CodingEnv({**good, "entry_point": "truncate number"})
    with pytest.raises(ValueError, match=r"^coding task 'HumanEval/2': column 'prompt' does not parse"):
        CodingEnv({**good, "prompt": "def truncate_number(:\n"})
    with pytest.raises(ValueError, match=r"^coding task '\?': column 'id' is missing$"):
        CodingEnv({k: v for k, v in good.items() if k != "id"})


async def test_every_canonical_solution_passes_every_hidden_test():
    """The splitter and harness against all 164 problems (about 20 s on 2 busy cores)."""
    backend, gate = get_backend(None, GRADER_LIMITS), asyncio.Semaphore(4)

    async def one(task):
        async with gate:
            return task["id"], await run_hidden_tests(backend, task["prompt"], task["canonical_solution"],
                                                      task["entry_point"], task["test"])

    reports = await asyncio.gather(*(one(t) for t in PROBLEMS.values()))
    failed = [(tid, r) for tid, r in reports if not r.compiled or r.share != 1.0]
    assert not failed
    assert sum(len(r.statuses) for _, r in reports) == 1133  # individually scored tests


@pytest.mark.integration
async def test_real_server_rollouts(play_on_server):
    limits = EpisodeLimits(max_turns=2, max_tokens_per_turn=256, max_total_tokens=2048)
    groups = await play_on_server(load_tasks(2, seed=0, split="eval"), lambda t: CodingEnv(t), limits)
    for t in (t for g in groups for t in g.trajectories):
        assert 0.0 <= t.reward <= 1.0 and set(t.reward_parts) == {"tests_passed", "submitted", "compiled", "solved"}
