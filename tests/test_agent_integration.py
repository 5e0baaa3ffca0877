"""Integration: an agent loop written with the real `openai` client, against the proxy, backed by a real
vLLM server (the tiny random model), records trajectories token-identical to the native runner's for
the same tasks and seeds: ids, loss mask and log-probs, turn for turn."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai", reason="agents are written with the openai client (pip install -e '.[agent]')")

from agent_rl.core.types import Message, StopReason  # noqa: E402
from agent_rl.envs import calculator, calculator_agent  # noqa: E402
from agent_rl.envs.agent_env import AgentEnv  # noqa: E402
from agent_rl.envs.base import StepResult, ToolEnv  # noqa: E402
from agent_rl.rollout.engine import rollout_groups  # noqa: E402
from agent_rl.rollout.runner import EpisodeLimits  # noqa: E402
from agent_rl.rollout.serving.choose import serving_backend  # noqa: E402
from agent_rl.tools.base import Tool  # noqa: E402

pytestmark = pytest.mark.integration

CALCULATOR = Tool(calculator.calculator)
FOLLOW_UP = "Are you sure? Check it with the calculator."


class FollowUpEnv(ToolEnv):
    """The native env: a calculator question; a reply without a tool call is asked again, twice."""

    def __init__(self, task):
        super().__init__([CALCULATOR])
        self.task, self.follow_ups = task, 0

    async def initial_messages(self):
        return [Message("system", calculator.SYSTEM), Message("user", self.task["question"])]

    async def step(self, reply, turn):
        result = await super().step(reply, turn)
        if result.done and self.follow_ups < 2:
            self.follow_ups += 1
            return StepResult(messages=(Message("user", FOLLOW_UP),))
        return result

    async def reward(self, messages):
        return float(str(self.task["answer"]) in messages[-1].content)


async def follow_up_agent(task, base_url):
    """The same episode as an agent loop any openai-client user would write."""
    messages = [{"role": "system", "content": calculator.SYSTEM}, {"role": "user", "content": task["question"]}]
    follow_ups = 0
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        while True:
            response = await client.chat.completions.create(model="policy", messages=messages,
                                                            tools=[CALCULATOR.schema],
                                                            temperature=0.0)  # the run samples
            choice = response.choices[0]
            messages.append(choice.message.model_dump(exclude_none=True))
            if choice.finish_reason == "length":
                return choice.message.content
            for call in choice.message.tool_calls or []:
                error = (call.model_extra or {}).get("error")
                if error:
                    content = f"Error: {error}"
                elif call.function.name != CALCULATOR.name:
                    content = f"Error: unknown tool {call.function.name!r}; available tools: calculator"
                else:
                    content = (await CALCULATOR.call(json.loads(call.function.arguments))).content
                messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
            if not choice.message.tool_calls:
                if follow_ups == 2:
                    return choice.message.content
                follow_ups += 1
                messages.append({"role": "user", "content": FOLLOW_UP})


def agent_env(task):
    return AgentEnv(task, follow_up_agent,
                    lambda task, messages, answer: float(str(task["answer"]) in messages[-1].content))


async def trajectories_on(server, make_env, renderer, limits, tasks):
    """Every trajectory of `tasks` x 3 played on `server`, in task order."""
    async with serving_backend().sampler([server.url]) as sampler:
        groups = await rollout_groups(tasks, make_env, sampler, renderer, limits, group_size=3)
    return [t for g in groups for t in g.trajectories]


@pytest.mark.parametrize("native, agent", [(FollowUpEnv, agent_env), (calculator.make_env, calculator_agent.make_env)],
                         ids=["follow-up-loop", "calculator_agent"])
async def test_openai_agent_on_vllm_is_token_identical_to_the_native_runner(vllm_server, renderer, native, agent):
    tasks = calculator.load_tasks(2, seed=5)
    limits = EpisodeLimits(max_turns=4, max_tokens_per_turn=24, max_total_tokens=1024, seed=11)
    expected = await trajectories_on(vllm_server, native, renderer, limits, tasks)
    got = await trajectories_on(vllm_server, agent, renderer, limits, tasks)
    for n, a in zip(expected, got):
        assert not n.infra_error and not a.infra_error, (n.error, a.error)
        assert (a.task_id, a.token_ids, a.loss_mask, a.turns, a.segments) == (n.task_id, n.token_ids, n.loss_mask,
                                                                              n.turns, n.segments)
        assert a.logprobs == n.logprobs and a.messages == n.messages and a.stop_reason is n.stop_reason
        assert a.reward == n.reward
    turns = [len(t.turns) for t in got]
    if native is FollowUpEnv:  # the tiny random model never calls the tool: its follow-ups make the turns
        assert sum(turns) > len(got), turns
    assert {t.stop_reason for t in got} <= {StopReason.NO_TOOL_CALL, StopReason.LENGTH, StopReason.MAX_TURNS}
