"""The math environment: reasoning-gym tasks, calculator and sandboxed python tools, math-verify reward."""

from __future__ import annotations

import pytest

from agent_rl.core.renderers.chatml import format_tool_call
from agent_rl.envs.calculator import calculator
from agent_rl.envs.math import MathEnv, final_step, load_tasks, make_env, math_dataset, solve
from agent_rl.rollout.runner import EpisodeLimits, run_episode
from agent_rl.tools.sandbox import get_backend

PARTS = {"correct_answer", "single_answer", "no_tool_markup", "tags_closed", "used_tools"}
LIMITS = EpisodeLimits(max_turns=6)


def _sandbox_problem() -> str | None:
    try:
        get_backend(None)
    except RuntimeError as e:
        return str(e)
    return None


SANDBOX_MISSING = _sandbox_problem()


@pytest.fixture(scope="module")
def tasks():
    return load_tasks(6, seed=0)  # gsm_symbolic and basic_arithmetic alternate


@pytest.fixture(scope="module")
def arithmetic(tasks):
    return next(t for t in tasks if t["source"] == "basic_arithmetic")


def test_splits_are_deterministic_and_disjoint(tasks):
    assert [t["source"] for t in tasks] == ["gsm_symbolic", "basic_arithmetic"] * 3
    assert load_tasks(6, seed=0) == tasks and load_tasks(6, seed=1) != tasks
    train = {t["prompt"][0]["content"] for t in load_tasks(100, seed=0)}
    evals = {t["prompt"][0]["content"] for t in load_tasks(100, seed=0, split="eval")}
    assert len(train) == len(evals) == 100 and not train & evals
    ds = math_dataset(4, seed=0)
    assert ds.column_names == ["id", "prompt", "answer", "source", "expression"]
    with pytest.raises(ValueError, match="unknown split 'test'"):
        math_dataset(2, split="test")


def test_expressions_compute_the_answers():
    rows = math_dataset(40, seed=3)
    assert all(float(calculator(r["expression"])) == float(r["answer"]) for r in rows if r["expression"])
    assert all(r["expression"] for r in rows if r["source"] == "basic_arithmetic")
    assert sum(bool(r["expression"]) for r in rows if r["source"] == "gsm_symbolic") >= 15  # most of the 20


def test_final_step_reads_the_last_computation():
    cot = "He has 35 x 3 = 105 kiwi.\nTotal: $160 + $128 = $288 items.\n#### 288"
    assert final_step(cot, "288") == "160 + 128"
    assert final_step("Bruce slew 2*300=600, or 600*0.5=300 trolls.", "300") == "600 * 0.5"
    assert final_step("So 12 ÷ 4 = 3 pies", "3") == "12 / 4"
    assert final_step("Thus 7 friends come.", "7") == ""  # no computation
    assert final_step("So 2 + 2 = 5", "5") == ""  # a step that does not compute the answer


def _bad_calls_then(task):
    """Malformed JSON, an unknown tool, a wrong argument, then the right tool call and answer."""
    replies = iter(['<tool_call>\n{"name": "calculator", "arguments": {"expression": }\n</tool_call>',
                    format_tool_call("abacus", {"expression": "1"}),
                    format_tool_call("calculator", {"expr": "1"}),
                    format_tool_call("calculator", {"expression": task["expression"]}),
                    f"So the answer is \\boxed{{{task['answer']}}}."])
    return lambda prompt: next(replies)


@pytest.mark.skipif(SANDBOX_MISSING is not None, reason=f"no sandbox for the python tool: {SANDBOX_MISSING}")
class TestEpisodes:
    async def test_scripted_solver_earns_full_reward(self, tasks, scripted, renderer):
        for task in tasks:
            for direct in (False, True):
                sampler = scripted(lambda m, task=task, direct=direct: solve(task, m, direct), on_messages=True)
                async with make_env(task) as env:
                    traj = await run_episode(env, sampler, renderer, LIMITS, task["id"])
                assert traj.error is None and traj.reward == 1.0, (task, traj.messages)
                tool_used = float(bool(task["expression"]) and not direct)
                assert traj.reward_parts == {p: 1.0 for p in PARTS} | {"used_tools": tool_used}

    async def test_wrong_answer_earns_nothing(self, arithmetic, scripted, renderer):
        wrong = int(arithmetic["answer"]) + 1
        async with make_env(arithmetic) as env:
            traj = await run_episode(env, scripted(lambda p: f"\\boxed{{{wrong}}}"), renderer, LIMITS, "w")
        assert traj.reward == 0.0 and traj.reward_parts["correct_answer"] == 0.0
        answers = f"{wrong}, {arithmetic['answer']}"  # hedging: the right number in a list
        async with make_env(arithmetic) as env:
            traj = await run_episode(env, scripted(lambda p: f"It is one of {answers}"), renderer, LIMITS, "h")
        assert traj.reward == 0.0 and traj.reward_parts["single_answer"] == 0.0

    async def test_malformed_tool_calls_get_errors_and_the_episode_goes_on(self, arithmetic, scripted, renderer):
        async with make_env(arithmetic) as env:
            traj = await run_episode(env, scripted(_bad_calls_then(arithmetic)), renderer, LIMITS, "m")
        tool_msgs = [m.content for m in traj.messages if m.role == "tool"]
        assert tool_msgs[0].startswith("Error: tool call 1: malformed JSON")
        assert tool_msgs[1].startswith("Error: unknown tool 'abacus'; available tools: calculator, python")
        assert tool_msgs[2].startswith("Error: invalid arguments for calculator")
        assert tool_msgs[3] == arithmetic["answer"]
        assert [c.ok for c in traj.tool_calls] == [False, False, False, True]
        assert traj.reward == 1.0 and traj.reward_parts["used_tools"] == 1.0

    async def test_python_tool_runs_sandboxed_and_is_closed(self, arithmetic, scripted, renderer):
        code = f"x = {arithmetic['expression']}\nprint(int(x) if x == int(x) else x)"

        def script(prompt):
            if "<tool_response>" not in prompt:
                return format_tool_call("python", {"code": code})
            return f"The answer is \\boxed{{{arithmetic['answer']}}}."

        env = make_env(arithmetic)
        async with env:
            traj = await run_episode(env, scripted(script), renderer, LIMITS, "py")
            assert env._python._session is not None
        assert env._python._session is None  # the sandbox went with the episode
        assert traj.messages[3].content.startswith("[ok | exit code 0")
        assert traj.messages[3].content.splitlines()[-1] == arithmetic["answer"]
        assert traj.reward == 1.0


def test_malformed_row_names_the_row_and_column():
    with pytest.raises(ValueError, match=r"dataset row id 'x', column 'answer': missing"):
        MathEnv({"id": "x", "prompt": [{"role": "user", "content": "1 + 1?"}]})
    with pytest.raises(ValueError, match=r"dataset row id 'y', column 'prompt': message 0 has role 'robot'"):
        MathEnv({"id": "y", "prompt": [{"role": "robot", "content": "1 + 1?"}], "answer": "2"})


@pytest.mark.integration
async def test_real_server_rollouts(play_on_server):
    limits = EpisodeLimits(max_turns=3, max_tokens_per_turn=128, max_total_tokens=1536)
    groups = await play_on_server(load_tasks(2, seed=0, split="eval"), make_env, limits)
    for t in (t for g in groups for t in g.trajectories):
        assert 0.0 <= t.reward <= 1.0 and set(t.reward_parts) == PARTS
