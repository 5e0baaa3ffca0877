"""Dataset rows as tasks (TRL's conversational and plain formats) and RubricEnv, with the scripted sampler."""

from __future__ import annotations

import datasets
import pytest

from agent_rl.core.renderers.chatml import format_tool_call
from agent_rl.core.types import Message, Reward
from agent_rl.envs.dataset import RubricEnv, row_to_task, tasks_from_dataset
from agent_rl.rewards.answers import correct_answer
from agent_rl.rewards.format import used_tools
from agent_rl.rewards.rubric import Rubric
from agent_rl.rollout.runner import EpisodeLimits, run_episode
from agent_rl.tools.base import ToolError


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    if abs(a) > 10**9 or abs(b) > 10**9:
        raise ToolError("numbers must be at most 10**9")
    return a + b


def dataset() -> datasets.Dataset:
    return datasets.Dataset.from_list([
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 20 + 22?"}],
         "answer": "42", "level": 1},
        {"prompt": [{"role": "user", "content": "What is 1 + 2?"}], "answer": "3", "level": 0},
    ])


def test_rows_of_each_format_become_tasks():
    conv = tasks_from_dataset(dataset())
    assert [t["id"] for t in conv] == ["row-0", "row-1"]
    assert conv[0]["prompt"][1] == {"role": "user", "content": "What is 20 + 22?"}
    assert (conv[0]["answer"], conv[0]["level"]) == ("42", 1)
    plain = tasks_from_dataset(datasets.Dataset.from_list([{"id": "p1", "prompt": "Hi?", "answer": "1"}]))
    assert plain[0]["prompt"] == [{"role": "user", "content": "Hi?"}] and plain[0]["id"] == "p1"
    question = row_to_task({"id": 7, "question": "Why?", "answer": "x"})
    assert question["prompt"] == [{"role": "user", "content": "Why?"}] and question["id"] == "7"
    assert question["question"] == "Why?"  # every column but the prompt stays for the rewards


@pytest.mark.parametrize(("row", "message"), [
    ({"answer": "1"}, r"dataset row 3: no 'prompt' or 'question' column \(columns: answer\)"),
    ({"id": "q", "prompt": "What?"}, r"dataset row 3 \(id 'q'\), column 'answer': missing"),
    ({"prompt": "What?", "answer": ""}, r"dataset row 3, column 'answer': empty"),
    ({"prompt": [], "answer": "1"}, r"dataset row 3, column 'prompt': expected a non-empty list"),
    ({"prompt": None, "answer": "1"}, r"column 'prompt': expected .* got None"),
    ({"prompt": [{"role": "bot", "content": "hi"}], "answer": "1"},
     r"dataset row 3, column 'prompt': message 0 has role 'bot' \(expected one of system, user, assistant\)"),
    ({"prompt": [{"role": "user", "content": "  "}], "answer": "1"}, r"column 'prompt': message 0 \(user\) has empty"),
    ({"prompt": [{"role": "user"}], "answer": "1"}, r"column 'prompt': message 0 is not a \{role, content\} dict"),
    ({"prompt": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "answer": "1"},
     r"message 1 is a system message; only the first may be"),
    ({"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "answer": "1"},
     r"column 'prompt': the last message is 'assistant'"),
    ({"question": 5, "answer": "1"}, r"column 'question': expected a string, got int"),
    ({"id": "", "question": "a", "answer": "1"}, r"column 'id': expected a non-empty string or integer"),
    ({"question": "a", "answer": "1", "completions": "x"}, r"column 'completions': reserved"),
])
def test_malformed_rows_name_the_row_and_column(row, message):
    rows = [{"question": "ok", "answer": "1"}] * 3 + [row]
    with pytest.raises(ValueError, match=message) as e:
        tasks_from_dataset(rows, required=("answer",))
    assert "\n" not in str(e.value)


def test_duplicate_ids_are_rejected():
    with pytest.raises(ValueError, match=r"dataset row 1, column 'id': id 'a' repeats row 0"):
        tasks_from_dataset([{"id": "a", "question": "x"}, {"id": "a", "question": "y"}])


def _env(task, **kw) -> RubricEnv:
    rubric = Rubric([(correct_answer, 1.0), (used_tools, 0.0)])
    return RubricEnv(task, [add], rubric, system_prompt="Use the add tool.", required=("answer",), **kw)


async def test_rubric_env_plays_a_dataset_row(scripted, renderer):
    task = tasks_from_dataset(dataset())[0]

    def solve(prompt):
        if "<tool_response>" not in prompt:
            return format_tool_call("add", {"a": 20, "b": 22})
        return "The answer is \\boxed{42}."

    async with _env(task) as env:
        opening = await env.initial_messages()
        traj = await run_episode(env, scripted(solve), renderer, EpisodeLimits(), task["id"])
    # the env's system prompt opens, merged with the row's own system message
    assert [(m.role, m.content) for m in opening] == [("system", "Use the add tool.\n\nBe brief."),
                                                      ("user", "What is 20 + 22?")]
    assert traj.error is None and traj.reward == 1.0
    assert traj.reward_parts == {"correct_answer": 1.0, "used_tools": 1.0}
    assert traj.messages[3].role == "tool" and traj.messages[3].content == "42"

    async with _env(task) as env:
        traj = await run_episode(env, scripted(lambda p: "It is \\boxed{41}."), renderer, EpisodeLimits(), "x")
    assert traj.reward == 0.0 and traj.reward_parts == {"correct_answer": 0.0, "used_tools": 0.0}


async def test_rubric_env_gets_the_completion_and_columns():
    seen = {}

    def spy(prompts, completions, answer, level, **kwargs):
        seen.update(prompts=prompts, completions=completions, answer=answer, level=level, id=kwargs["id"])
        return [0.25]

    task = tasks_from_dataset(dataset())[1]
    env = RubricEnv(task, [add], Rubric([(spy, 2.0)]))
    call = format_tool_call("add", {"a": 1, "b": 2})
    messages = [*await env.initial_messages(), Message("assistant", call), Message("tool", "3", name="add"),
                Message("assistant", "3")]
    assert await env.reward(messages) == Reward(0.5, {"spy": 0.25})
    assert seen == {
        "prompts": [[{"role": "user", "content": "What is 1 + 2?"}]],
        "completions": [[{"role": "assistant", "content": call}, {"role": "tool", "content": "3", "name": "add"},
                         {"role": "assistant", "content": "3"}]],
        "answer": ["3"], "level": [0], "id": ["row-1"],
    }


def test_rubric_env_checks_its_row():
    with pytest.raises(ValueError, match=r"dataset row id 'q', column 'answer': missing"):
        _env({"id": "q", "question": "What?"})
