"""Samplers that do not sample: canned replies for tests, a scripted solver for demonstrations.

Owns: `ScriptedSampler`, whose replies come from a function of the prompt text (unit tests of
multi-turn loops) or of the conversation's messages (an environment's scripted `solve`, for the
demonstrations of a cold start); a reply given as a `Message` is written in the model's own format by
the renderer (`Renderer.reply_ids`).
Does not own: the episode loop (`rollout.runner`), the solvers (each environment's `solve`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agent_rl.core.renderers.base import Renderer
from agent_rl.core.types import Message
from agent_rl.rollout.sampler import Completion, SamplingParams


@dataclass
class ScriptedSampler:
    """`script(prompt_text)` (or `script(messages)` with `on_messages`) -> the reply, as text or as a
    `Message` with tool calls. The reply is encoded canonically and closed with the stop token,
    unless `max_tokens` cuts it ("length"). Every sampled token gets log-prob `logprob`."""

    renderer: Renderer
    script: Callable[..., str | Message]
    logprob: float = -0.5
    on_messages: bool = False
    policy_version: int = 0
    calls: list[list[int]] = field(default_factory=list)

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
                     messages: Sequence[Message] = ()) -> Completion:
        self.calls.append(list(prompt_ids))
        reply = self.script(list(messages) if self.on_messages else self.renderer.render_text(prompt_ids))
        if isinstance(reply, Message):
            ids = self.renderer.reply_ids(reply)
        else:
            ids = [*self.renderer.encode_reply(reply), self.renderer.stop_token_ids[0]]
        finish = "stop"
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
        await asyncio.sleep(0)  # yield like a real client would
        return Completion(tuple(ids), tuple([self.logprob] * len(ids)), finish, self.policy_version)
