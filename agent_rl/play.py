"""A person plays the policy's part: debug an environment in a terminal before training on it.

Owns: `HumanSampler` (a `Sampler` whose completions are typed by a person, or read from a script)
and `play` (one episode through the real rollout runner, then its reward and tool calls).
Does not own: the episode loop (`rollout.runner.run_episode`: what you see is what a model would
get), rendering (`core.renderers.base`), the environment.

Typing a reply: end it with a line holding only `.` (or end of input). Shortcuts:
    /call NAME {"arg": value}     one tool call, written out in the model's tool-call format
    /quit                         abandon the episode
Anything else is the assistant's message text, verbatim (including hand-written <tool_call> tags).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from agent_rl.core.registry import EnvSpec
from agent_rl.core.renderers.base import Renderer
from agent_rl.core.types import Message, ToolCall, Trajectory
from agent_rl.rollout.runner import EpisodeLimits, run_episode
from agent_rl.rollout.sampler import Completion, SamplingParams


class QuitEpisode(Exception):
    """The player typed /quit or the input ended before a reply."""


def read_reply(stream: TextIO, renderer: Renderer) -> str:
    """One reply from `stream`: lines up to a lone `.`, with the /call and /quit shortcuts (a call
    written in the model's own format)."""
    lines: list[str] = []
    while True:
        line = stream.readline()
        if not line:  # end of input
            if not lines:
                raise QuitEpisode("input ended before a reply")
            break
        line = line.rstrip("\n")
        if line.strip() == "/quit":
            raise QuitEpisode("the player quit")
        if line.strip() == ".":
            break
        if line.startswith("/call "):
            name, _, raw = line[len("/call "):].strip().partition(" ")
            try:
                arguments = json.loads(raw or "{}")
            except json.JSONDecodeError as e:
                raise ValueError(f"/call {name}: arguments are not JSON ({e.msg}): {raw}") from None
            line = renderer.format_reply("", [ToolCall(name, arguments)])
        lines.append(line)
    return "\n".join(lines)


class HumanSampler:
    """Shows what the policy would see since the last turn, then reads the reply the person types."""

    policy_version = 0

    def __init__(self, renderer: Renderer, read: Callable[[], str], show: Callable[[str], None]):
        self.renderer, self.read, self.show = renderer, read, show
        self._seen = 0

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
                     messages: Sequence[Message] = ()) -> Completion:
        self.show(self.renderer.render_text(prompt_ids[self._seen:]))
        while True:
            try:
                text = await asyncio.to_thread(self.read)
                break
            except ValueError as e:  # a typo in a /call: say so and read the reply again
                self.show(f"error: {e}\n")
        ids = [*self.renderer.encode(text), self.renderer.stop_token_ids[0]]
        self._seen = len(prompt_ids) + len(ids)
        return Completion(tuple(ids), (0.0,) * len(ids), "stop", 0)


async def play(spec: EnvSpec, task: dict[str, Any], renderer: Renderer, stdin: TextIO,
               show: Callable[[str], None], limits: EpisodeLimits | None = None) -> Trajectory:
    """One episode of `task` with the person as the policy. A /quit ends it as an ERROR trajectory."""
    sampler = HumanSampler(renderer, lambda: read_reply(stdin, renderer), show)
    limits = limits or EpisodeLimits(max_turns=8, max_tokens_per_turn=4096, max_total_tokens=32768,
                                     env_timeout_s=300.0)
    async with spec.make_env(task) as env:
        return await run_episode(env, sampler, renderer, limits, str(task.get("id", "")))


def summary(traj: Trajectory) -> dict[str, Any]:
    """What a person wants to know after an episode, JSON-ready."""
    return {"task_id": traj.task_id, "reward": traj.reward, "reward_parts": traj.reward_parts,
            "stop_reason": traj.stop_reason.value, "error": traj.error, "turns": len(traj.turns),
            "tool_calls": [{"name": c.name, "ok": c.ok, "error": c.error} for c in traj.tool_calls]}
