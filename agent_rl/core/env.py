"""The environment protocol: what the rollout runner talks to.

Owns: `Env` (a small, async, message-level, single-use episode of one task, its `state_key`),
`StepResult` (with the turn's own reward), `as_reward`, `Task` (a task row: what `make_env` is given and
`load_tasks` returns) and `ToolSpec` (what the runner and the renderer need of a tool: its name and
JSON schema).
Does not own: tokens (the runner and the renderer handle those), tool dispatch (`envs.base.ToolEnv`,
the base class of tool-using environments), sampling, or reward weighting (`rewards.rubric`).

An episode, as the runner plays it:

    async with make_env(task) as env:             # the env owns its resources (sandboxes, clients)
        messages = await env.initial_messages()   # system + user
        while True:
            reply = <the policy samples; the renderer parses it into an assistant Message>
            result = await env.step(reply, turn)  # tool results / follow-ups, done?, the turn's reward
            if result.done: break
        reward = await env.reward(all_messages)   # the outcome: a float, or a Reward with named parts

Rewards. `Env.reward` is the episode's outcome. `StepResult.reward` is the reward of the turn just
taken (a float, or a `Reward` with parts; None for none), e.g. a penalty for a refused action: the
runner keeps it on that turn (`core.types.Turn`), and credit per turn reads it (`learn.credit`); a turn cut at its
token limit is never stepped, and gets `unparsed_turn_reward` instead (a failed call's).
Before each turn the runner asks `state_key()` for the state the turn starts from (GiGPO's step
groups); None, the default, means "the observation as rendered" (a hash of its token ids).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agent_rl.core.types import Message, Reward, StopReason, ToolCallRecord

# A task row: one JSON-like dict. An environment reads the columns it knows (`question`, `answer`,
# `prompt`, ...) and keeps any other column it was given; `id` names the task in trajectories and
# reports, and a mixture adds `env` (`core.mixture`). A name for the shape, not a narrower type:
# environments and datasets put arbitrary columns in a row.
Task = dict[str, Any]


class ToolSpec(Protocol):
    """What the runner and the renderer need of a tool: its name and its OpenAI-style function schema
    (rendered into the prompt). `tools.base.Tool` and MCP servers' tools are ones; calling them is
    the environment's business (`envs.base.ToolEnv`)."""

    @property
    def name(self) -> str: ...

    @property
    def schema(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class StepResult:
    """What the environment says after one assistant turn."""

    messages: tuple[Message, ...] = ()  # user or tool messages to append
    done: bool = False
    stop_reason: StopReason = StopReason.ENV_DONE  # read only when done
    tool_calls: tuple[ToolCallRecord, ...] = ()
    # the whole conversation from now on, when it is not the old one plus `messages` (an agent behind
    # `envs.agent_env` resent an edited history): the runner renders it anew, in a new segment unless
    # that render extends the token buffer
    history: tuple[Message, ...] | None = None
    reward: float | Reward | None = None  # the reward of the turn just taken (module doc); None: none


class Env(abc.ABC):
    """One episode of one task. Use it once, inside `async with`.

    `tools` are what the model may call (`ToolSpec`: a name and a schema, rendered into the prompt);
    `envs.base.ToolEnv` fills them from typed Python functions.
    """

    tools: Sequence[ToolSpec] = ()

    async def __aenter__(self) -> Env:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:  # noqa: B027  (optional: most environments own nothing)
        """Release what the environment owns (sandboxes, HTTP sessions)."""

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools]

    @abc.abstractmethod
    async def initial_messages(self) -> list[Message]:
        """The opening conversation: an optional system message, then the user's task."""

    @abc.abstractmethod
    async def step(self, reply: Message, turn: int) -> StepResult:
        """React to the policy's assistant message (exact text in `content`, parsed `tool_calls`)."""

    @abc.abstractmethod
    async def reward(self, messages: Sequence[Message]) -> float | Reward:
        """Score the finished conversation (the outcome): a float, or a `Reward` with its named parts."""

    async def unparsed_turn_reward(self, turn: int) -> float | Reward | None:
        """The reward of turn `turn`, cut at its token limit before it ended, so never parsed nor stepped: an
        unparsed turn is a failed call, so an environment with turn rewards charges what it charges a failed call
        (`envs.base.ToolEnv` steps one unreadable call). None (the default): none. The episode ends there."""
        return None

    async def state_key(self) -> str | None:
        """The environment's state now, as a key: turns of a group that start from equal keys are
        compared with each other (GiGPO's step groups, `learn.credit`). None (the default): the runner
        uses a hash of the observation as rendered, the token ids added since the last sampled turn."""
        return None


def as_reward(value: float | Reward) -> Reward:
    """What `Env.reward` returned, as a `Reward` (a bare number has no parts)."""
    if isinstance(value, Reward):
        return Reward(float(value.value), {k: float(v) for k, v in value.parts.items()})
    return Reward(float(value))
