"""The calculator tool and environment, with the scripted sampler."""

import pytest

from agent_rl.rollout.runner import EpisodeLimits, run_episode
from envs.calculator import CalculatorEnv, arithmetic_tasks, calculator
from rewards.answers import final_number, numeric_answer
from tools.base import ToolError


def test_calculator_evaluates_arithmetic_only():
    assert calculator("(3 + 4) * 12") == "84"
    assert calculator("7 / 2") == "3.5"
    assert calculator("-2 ** 3") == "-8"
    for bad, msg in [("__import__('os')", "unsupported expression element Call"), ("1 / 0", "division by zero"),
                     ("2 ** 1000", "exponent too large"), ("3 +", "cannot parse"), ("True + 1", "unsupported")]:
        with pytest.raises(ToolError, match=msg):
            calculator(bad)


def test_final_number_and_numeric_answer():
    assert final_number("So 12 + 3 = 15.") == 15.0
    assert final_number("<answer>1,234</answer> not 7") == 1234.0
    assert final_number('<tool_call>{"arguments": {"expression": "9"}}</tool_call> none') is None
    assert numeric_answer("The answer is 27.", 27) == 1.0 and numeric_answer("It is 28", 27) == 0.0


def test_tasks_are_deterministic_and_correct():
    rows = arithmetic_tasks(6, seed=3)
    assert rows == arithmetic_tasks(6, seed=3) and rows != arithmetic_tasks(6, seed=4)
    for row in rows:
        expression = row["question"].removeprefix("What is ").removesuffix("?")
        assert calculator(expression) == str(row["answer"])


async def test_tool_using_episode_earns_full_reward_and_a_wrong_answer_none(scripted, renderer):
    task = {"id": "t", "question": "What is (12 + 30) * 2?", "answer": 84}

    def solve(prompt):
        if "<tool_response>" not in prompt:
            return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "(12 + 30) * 2"}}\n</tool_call>'
        return "The answer is 84."

    async with CalculatorEnv(task) as env:
        traj = await run_episode(env, scripted(solve), renderer, EpisodeLimits(), "t")
    assert traj.reward == 1.0 and traj.reward_parts == {"correct": 1.0}
    assert traj.messages[3].content == "84" and traj.tool_calls[0].ok
    async with CalculatorEnv(task) as env:
        traj = await run_episode(env, scripted(lambda p: "It is 80."), renderer, EpisodeLimits(), "t")
    assert traj.reward == 0.0 and traj.tool_calls == ()


def test_malformed_row_names_the_column():
    with pytest.raises(ValueError, match="calculator task 'x' has no 'answer' column"):
        CalculatorEnv({"id": "x", "question": "1+1?"})
