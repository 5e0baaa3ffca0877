"""Tasks from any Hugging Face `datasets.Dataset`, played by `RubricEnv` and scored by a `Rubric`.

Owns: turning dataset rows into task dicts (`row_to_task`, `tasks_from_dataset`) with validation
that names the row and the column, and `RubricEnv`: a `ToolEnv` whose opening messages are the row's
prompt and whose reward is a rubric over the completion, with the row's other columns as keyword
arguments (TRL's convention, so TRL reward functions and datasets work unchanged).
Does not own: reward functions (`rewards`), tools (`tools`), where the dataset comes from.

Row formats, as TRL reads them:
  * conversational: `prompt` = a list of {"role", "content"} messages (system first if any,
    ending with the user's message);
  * plain: `prompt` = a string, or no `prompt` but a `question` string: one user message.
Every column but `prompt` goes to the reward functions (`answer`, `id`, your own ...). A task's
"id" is its `id` column, else "row-<index>".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from agent_rl.core.env import Task
from agent_rl.core.types import Message, Reward
from agent_rl.envs.base import ToolEnv
from agent_rl.rewards.rubric import Messages, Rubric
from agent_rl.tools.base import Tool

PROMPT_ROLES = ("system", "user", "assistant")
RESERVED = ("prompts", "completions")  # TRL passes these itself


def _where(index: int | None, row_id: Any) -> str:
    """Where a row is, for errors: dataset row 3 (id 'q7'), dataset row 3, or dataset row id 'q7'."""
    if index is None:
        return "dataset row" + (f" id {row_id!r}" if row_id is not None else "")
    return f"dataset row {index}" + (f" (id {row_id!r})" if row_id is not None else "")


def _prompt_messages(value: Any, where: str, column: str) -> Messages:
    fail = f"{where}, column {column!r}"
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{fail}: empty prompt")
        return [{"role": "user", "content": value}]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{fail}: expected a non-empty list of {{role, content}} messages or a string, "
                         f"got {type(value).__name__ if value is not None else 'None'}")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"{fail}: message {i} is not a {{role, content}} dict: {str(m)[:80]!r}")
        role, content = m["role"], m["content"]
        if role not in PROMPT_ROLES:
            raise ValueError(f"{fail}: message {i} has role {role!r} (expected one of {', '.join(PROMPT_ROLES)})")
        if role == "system" and i != 0:
            raise ValueError(f"{fail}: message {i} is a system message; only the first may be")
        if not isinstance(content, str) or not content.strip():
            raise ValueError(f"{fail}: message {i} ({role}) has empty or non-string content")
        messages.append({"role": role, "content": content})
    if messages[-1]["role"] != "user":
        raise ValueError(f"{fail}: the last message is {messages[-1]['role']!r}; a prompt ends with the user's message")
    return messages


def row_to_task(row: Mapping[str, Any], index: int | None = None, required: Sequence[str] = ()) -> Task:
    """A validated task: the row's columns, "id" set, "prompt" as a list of message dicts.

    `required`: columns the rewards need (e.g. "answer"), which must be present and not None or "".
    Raises a one-line ValueError naming the row (index and/or id) and the column at fault.
    """
    if not isinstance(row, Mapping):
        raise ValueError(f"{_where(index, None)}: expected a mapping of columns, got {type(row).__name__}")
    row_id = row.get("id")
    where = _where(index, row_id)
    if "id" in row and (not isinstance(row_id, (str, int)) or isinstance(row_id, bool) or str(row_id) == ""):
        raise ValueError(f"{where}, column 'id': expected a non-empty string or integer")
    for name in required:
        if row.get(name) is None or row.get(name) == "":
            raise ValueError(f"{where}, column {name!r}: {'missing' if name not in row else 'empty'}")
    for name in RESERVED:
        if name in row:
            raise ValueError(f"{where}, column {name!r}: reserved (TRL passes {name!r} to reward functions itself)")
    if "prompt" in row:
        prompt = _prompt_messages(row["prompt"], where, "prompt")
    elif "question" in row:
        if not isinstance(row["question"], str):
            raise ValueError(f"{where}, column 'question': expected a string, got {type(row['question']).__name__}")
        prompt = _prompt_messages(row["question"], where, "question")
    else:
        raise ValueError(f"{where}: no 'prompt' or 'question' column (columns: {', '.join(map(str, row)) or 'none'})")
    task_id = str(row_id) if row_id is not None else "row" if index is None else f"row-{index}"
    return {**row, "id": task_id, "prompt": prompt}


def tasks_from_dataset(dataset: Iterable[Mapping[str, Any]], required: Sequence[str] = ()) -> list[Task]:
    """Every row of a `datasets.Dataset` (or any iterable of row dicts) as a validated task; ids unique."""
    tasks = [row_to_task(row, i, required) for i, row in enumerate(dataset)]
    seen: dict[str, int] = {}
    for i, task in enumerate(tasks):
        if task["id"] in seen:
            raise ValueError(f"dataset row {i}, column 'id': id {task['id']!r} repeats row {seen[task['id']]}")
        seen[task["id"]] = i
    return tasks


class RubricEnv(ToolEnv):
    """One dataset row: its prompt opens the episode, tools answer calls, the rubric scores it.

    The episode ends at the first reply without a tool call. `system_prompt`, when given, opens
    the conversation (before the row's own system message text, if it has one). `required` names
    the columns the rubric needs, checked when the env is made.
    """

    def __init__(self, task: Mapping[str, Any], tools: Sequence[Callable[..., Any] | Tool], rubric: Rubric,
                 system_prompt: str | None = None, required: Sequence[str] = (), max_parallel_calls: int = 8):
        super().__init__(tools, max_parallel_calls)
        self.task = row_to_task(task, required=required)
        self.rubric = rubric
        prompt = [dict(m) for m in self.task["prompt"]]
        if system_prompt:
            if prompt[0]["role"] == "system":
                prompt[0]["content"] = f"{system_prompt}\n\n{prompt[0]['content']}"
            else:
                prompt.insert(0, {"role": "system", "content": system_prompt})
        self.prompt: Messages = prompt

    async def initial_messages(self) -> list[Message]:
        return [Message(m["role"], m["content"]) for m in self.prompt]

    async def reward(self, messages: Sequence[Message]) -> Reward:
        completion = [_as_dict(m) for m in messages[len(self.prompt):]]
        columns = {k: v for k, v in self.task.items() if k != "prompt"}
        score = await self.rubric.score(self.prompt, completion, **columns)
        return Reward(score.total, dict(score.parts))


def _as_dict(m: Message) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name is not None:
        d["name"] = m.name
    return d
