"""A verifiers taskset written with verifiers' public API (`verifiers.v1`), loaded by its id `vf_add_taskset`.

The task of tests/test_rollout_tokens.py ("2+3+4?" with an `add` tool, system prompt "Use tools."), so a
verifiers episode can be checked against the ids written out there by hand: a `Toolset` whose `@vf.tool`
is advertised bare (`TOOL_PREFIX = None`), a `@vf.reward` and a `@vf.metric`; `fail_reward: true` makes the
reward raise (an error inside the foreign environment).
"""

import verifiers.v1 as vf


class AddData(vf.TaskData):
    answer: str


class AddState(vf.State):
    calls: int = 0


class AddTools(vf.Toolset[vf.ToolsetConfig, AddState]):
    TOOL_PREFIX = None

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: first
            b: second
        """
        self.state.calls += 1
        return a + b


class AddTaskConfig(vf.TaskConfig):
    fail_reward: bool = False


class AddTask(vf.Task[AddData, AddState, AddTaskConfig]):
    @classmethod
    def toolsets(cls, config: AddTaskConfig) -> list[vf.Toolset]:
        return [AddTools(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        if self.config.fail_reward:
            raise KeyError("no answer key")
        return float(self.data.answer in trace.last_reply)

    @vf.reward(weight=0.0)
    async def add_calls(self, trace: vf.Trace) -> float:
        return float(trace.state.calls)

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class AddConfig(vf.TasksetConfig):
    num_tasks: int = 10
    task: AddTaskConfig = AddTaskConfig()


class AddTaskset(vf.Taskset[AddTask, AddConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            data = AddData(id=f"add-{i}", prompt="2+3+4?", system_prompt="Use tools.", answer="9")
            yield AddTask(data, self.config.task)


__all__ = ["AddTaskset"]


async def brevity(trace: vf.Trace) -> float:
    """A dense reward to plug in through the task's config (verifiers' `TaskConfig.rewards`), for tests whose
    tiny random model never answers right: shorter final replies score more."""
    return max(0.0, 1.0 - len(trace.last_reply) / 100)
