"""A verifiers taskset whose tasks end themselves with `@vf.stop` hooks, and one whose prompt holds an image.

`vf_stop_taskset`: a `tick` tool counting in the episode's state; `stop_on` (the task's config) picks the hook
that fires: `ticks` (a trace hook: two ticks are enough), `give_up` (a response hook: a reply saying "I GIVE
UP"), `long_request` (a request hook: a request of more than four messages). `vf_stop_taskset:ImageTaskset`
(`image: true` in its args) sends "Here are 2 squares." with the squares as an image part, as verifiers'
`color_codeword` does.
"""

import verifiers.v1 as vf

SQUARE = "data:image/png;base64,iVBORw0KGgo="  # the bytes do not matter: no text-only chat format can take them


class TickState(vf.State):
    ticks: int = 0


class TickTools(vf.Toolset[vf.ToolsetConfig, TickState]):
    TOOL_PREFIX = None

    @vf.tool
    def tick(self) -> int:
        """Count one tick."""
        self.state.ticks += 1
        return self.state.ticks


class StopTaskConfig(vf.TaskConfig):
    stop_on: str = "ticks"


class StopTask(vf.Task[vf.TaskData, TickState, StopTaskConfig]):
    @classmethod
    def toolsets(cls, config: StopTaskConfig) -> list[vf.Toolset]:
        return [TickTools(vf.ToolsetConfig())]

    @vf.stop
    def enough_ticks(self, trace: vf.Trace) -> bool:
        return self.config.stop_on == "ticks" and trace.state.ticks >= 2

    @vf.stop
    def gave_up(self, response: vf.Response) -> bool:
        return self.config.stop_on == "give_up" and "I GIVE UP" in (response.message.content or "")

    @vf.stop
    def long_request(self, request: vf.Request) -> bool:
        return self.config.stop_on == "long_request" and len(request.messages) > 4

    @vf.metric
    async def ticks(self, trace: vf.Trace) -> float:
        return float(trace.state.ticks)


class StopConfig(vf.TasksetConfig):
    num_tasks: int = 5
    image: bool = False
    task: StopTaskConfig = StopTaskConfig()


class StopTaskset(vf.Taskset[StopTask, StopConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            prompt = ([vf.UserMessage(content=[vf.TextContentPart(text="Here are 2 squares."), vf.ImageUrlContentPart(
                image_url=vf.ImageUrlSource(url=SQUARE))])] if self.config.image else "Tick until told to stop.")
            yield StopTask(vf.TaskData(id=f"tick-{i}", prompt=prompt, system_prompt="Use tools."), self.config.task)


__all__ = ["StopTaskset"]
