"""The calculator tool and environment, with the scripted sampler."""

import pytest

from agent_rl.envs.calculator import CalculatorEnv, arithmetic_tasks, calculator
from agent_rl.rewards.answers import final_number, numeric_answer
from agent_rl.rollout.runner import EpisodeLimits, run_episode
from agent_rl.tools.base import ToolError


def test_calculator_evaluates_arithmetic_only():
    assert calculator("(3 + 4) * 12") == "84"
    assert calculator("7 / 2") == "3.5"
    assert calculator("-2 ** 3") == "-8"
    for bad, msg in [("__import__('os')", "unsupported expression element Call"), ("1 / 0", "division by zero"),
                     ("2 ** 4000", "result too large"), ("3 +", "cannot parse"), ("True + 1", "unsupported")]:
        with pytest.raises(ToolError, match=msg):
            calculator(bad)


NINES = "*".join(["9**64"] * 18)  # 18 products of 204 bits: 3,654 bits, over the 3,322-bit limit


@pytest.mark.parametrize("expression, message", [
    ("(((9**64)**64)**64)**64", "result too large .limit 1000 digits."),  # used to take ~20 s, holding the GIL
    ("((((9**64)**64)**64)**64)**64", "result too large"),  # hours
    ("10**(10**100)", "result too large"), ("2**(2**64)", "result too large"), ("(-7)**3333", "result too large"),
    (NINES, "result too large"), ("(10**500) * (10**500)", "result too large"),
    ("(2**3000) * (2**3000) * (2**3000)", "result too large"),
    ("1e308 * 10", "not a finite number"), ("1e999", "not a finite number"), ("1.5 ** 10**100", "overflow"),
    ("(10**999) ** -1", "overflow"), ("10**400 / 3.0", "overflow"), ("(-8) ** 0.5", "not a real number"),
])
def test_results_are_bounded_before_they_are_computed(expression, message):
    assert len(expression) <= 200
    with pytest.raises(ToolError, match=message):
        calculator(expression)


def test_results_up_to_the_bound_are_exact():
    assert calculator("9**64") == str(9**64)
    assert calculator("2**3321") == str(2**3321)  # 1,000 digits: the largest power of two allowed
    assert calculator("(10**999) * 9") == str(10**999 * 9) and calculator("-(10**999) - 1") == str(-10**999 - 1)
    assert calculator(NINES.rsplit("*", 6)[0]) == str(9 ** (64 * 16))
    assert calculator("2 ** -2") == "0.25" and calculator("(10**400) // 10**399") == "10"
    assert calculator("1 ** (10**100)") == "1" and calculator("0.5 ** 10**100") == "0"


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
