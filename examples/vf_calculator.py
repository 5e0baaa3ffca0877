"""The calculator environment written as a verifiers taskset (verifiers' v1 API), to train through
agent_rl.envs.verifiers_env (examples/verifiers_grpo.yaml): what an environment from the verifiers
ecosystem looks like to agent-rl.

A `Taskset` of arithmetic questions (the rows of agent_rl.envs.calculator), a `Toolset` serving the
calculator as an `@vf.tool` (advertised bare, `TOOL_PREFIX = None`, so the model sees the tool it knows),
a `Task` scored by `@vf.reward` (the one final number, as the native environment scores it) and a
`@vf.metric`; and agent-rl's scripted solver `solve`, which verifiers has no notion of, for demonstrations.
"""

from __future__ import annotations

import verifiers.v1 as vf

from agent_rl.core.types import Message
from agent_rl.envs import calculator as native
from agent_rl.rewards.answers import correct_answer


class CalculatorData(vf.TaskData):
    answer: str
    expression: str


class CalculatorTools(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None

    @vf.tool
    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: Arithmetic using numbers, + - * / // % ** and parentheses, e.g. "(3 + 4) * 12".
        """
        return str(native.calculator(expression))


class CalculatorTask(vf.Task[CalculatorData]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [CalculatorTools(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        [score] = await correct_answer([trace.last_reply], [self.data.answer])
        return score

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class CalculatorConfig(vf.TasksetConfig):
    num_tasks: int = 500
    seed: int = 0


class CalculatorTaskset(vf.Taskset[CalculatorTask, CalculatorConfig]):
    def load(self):
        for row in native.arithmetic_tasks(self.config.num_tasks, self.config.seed):
            data = CalculatorData(id=row["id"], prompt=row["question"], system_prompt=native.SYSTEM,
                                  answer=str(row["answer"]), expression=row["expression"])
            yield CalculatorTask(data, self.config.task)


def solve(data: CalculatorData, messages: list[Message], direct: bool = False) -> Message:
    """agent-rl's demonstration: the native calculator's solver on this task's data."""
    return native.solve({"answer": data.answer, "expression": data.expression}, messages, direct)


__all__ = ["CalculatorTaskset"]
