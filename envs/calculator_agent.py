"""The calculator task played by an agent written with the `openai` client: bring your own agent.

Owns: `calculator_agent`, about 30 lines of ordinary agent code (`openai.AsyncOpenAI(base_url=...)`,
a tool loop, the final answer), its reward, and its spec `ENV` (what the registry reads), so
`rollout.env: agent_rl.envs.calculator_agent` trains on it.
Does not own: the episode plumbing (`envs.agent_env`, `envs.agent_proxy`); the tasks, the system
prompt and the scripted solver (`envs.calculator`); the tool (`tools.calculator`).

The agent asks what `envs.calculator` asks, offers the same tool and answers calls as `ToolEnv`
would, so the runner records the very tokens it records for the native env (the tests compare them,
id for id). Needs the `openai` package (`pip install -e '.[agent]'`; vLLM depends on it too).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from openai import AsyncOpenAI

from agent_rl.core.env import Task
from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import Message, Reward
from agent_rl.envs.agent_env import AgentEnv
from agent_rl.envs.calculator import SYSTEM, calculator, load_tasks, solve
from agent_rl.rewards.answers import correct_answer
from agent_rl.tools.base import Tool

__all__ = ["calculator_agent", "load_tasks", "make_env", "score", "solve"]

CALCULATOR = Tool(calculator)


async def calculator_agent(task: Task, base_url: str) -> str:
    """Ask the question, run every tool call the model makes, return its final answer."""
    # plain JSON dicts, as sent (the client's TypedDicts describe the same dicts)
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": str(task["question"])}]
    tools: list[Any] = [CALCULATOR.schema]
    async with AsyncOpenAI(base_url=base_url, api_key="agent-rl", max_retries=0) as client:
        while True:  # the run ends the episode at its turn limit: the next request is refused
            response = await client.chat.completions.create(model="policy", messages=messages, tools=tools)
            choice = response.choices[0]
            messages.append(choice.message.model_dump(exclude_none=True))
            if not choice.message.tool_calls or choice.finish_reason == "length":
                return choice.message.content or ""
            for call in choice.message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": await run_tool(call)})


async def run_tool(call: Any) -> str:
    """A tool message's text for one call, as `envs.base.ToolEnv` writes it."""
    error = (call.model_extra or {}).get("error")  # the proxy's note on a call it could not read
    if error:
        return f"Error: {error}"
    if call.function.name != CALCULATOR.name:
        return f"Error: unknown tool {call.function.name!r}; available tools: {CALCULATOR.name}"
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError as e:
        return f"Error: arguments are not JSON ({e.msg})"
    return (await CALCULATOR.call(arguments)).content


async def score(task: Task, messages: Sequence[Message], answer: Any) -> Reward:
    """The calculator's reward: the one final number of the last reply, right or wrong."""
    final = messages[-1].content if messages and messages[-1].role == "assistant" else ""
    [correct] = await correct_answer([final], [task["answer"]])
    return Reward(correct, {"correct": correct})


def make_env(task: Task) -> AgentEnv:
    return AgentEnv(task, calculator_agent, score)


# no audit target of its own: the reward audit plays the generic one (the rows' `answer` column)
ENV = EnvSpec("calculator_agent", make_env, load_tasks, solve=solve)
