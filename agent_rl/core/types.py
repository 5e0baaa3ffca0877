"""Every RL noun of agent-rl in one place: messages, tool calls, sampled turns, trajectories, groups.

Owns: plain data types shared by the rollout runner, the environments, rewards and the trainer.
Does not own: any behaviour beyond small derived properties (rendering and parsing live in
`core.renderers.base`, sampling in `rollout.sampler`, playing an episode in `rollout.runner`).

Token-level truth: a `Trajectory` holds the exact token ids the sampler produced plus the
template/tool tokens inserted between turns, a loss mask aligned one to one with them
(1 = sampled by the policy, 0 = prompt, template scaffolding, tool output), the sampler's
log-probs (0.0 where mask == 0) and the policy version that sampled each token (-1 where mask == 0):
with weights pushed while episodes run, an episode's later turns, or the rest of a turn a push
interrupted, come from a newer version than its first.

Segments: when a chat template rewrites earlier turns (the generic fallback renderer finds that the
new prompt does not extend the token buffer), the episode goes on in a new `Segment` whose context is
the fresh render. A trajectory's own `token_ids` / `loss_mask` / `logprobs` are its last (current)
segment; `segments` holds the earlier, closed ones, oldest first (usually none). The trainer turns
every segment into its own row with the trajectory's advantage (`learn.batching.collate`).

Rewards: `Trajectory.reward` is the episode's outcome (`Env.reward`, plus any group reward); each `Turn`
holds the reward of that turn alone (`StepResult.reward`), aligned to its sampled tokens. The episode's
return, what its group's statistics compare, is made of both and the truncation rule by one function
(`core.returns.episode_return`) once its group has ended, and kept as `Trajectory.ret`: advantages, credit,
dynamic sampling and the metrics read it. Reported reward and success read the outcome only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class ToolCall:
    """One call the model attempted: a tool name and JSON arguments, or why it is not a call.

    `error` is set when the attempt could not be read (malformed JSON, an unclosed tag, no name...);
    `name` then holds whatever name could be read, possibly "". Every attempt, readable or not,
    gets exactly one tool message back.
    """

    name: str
    arguments: dict[str, Any]
    id: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Message:
    """A chat message.

    A sampled assistant message holds the exact decoded text of the turn in `content` (tool-call
    markup included) and the renderer's parse of that text in `tool_calls`. A reply written by hand
    (a scripted solver's, a person's) is turned into text by `Renderer.format_reply`.
    """

    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    name: str | None = None  # the tool's name on role == "tool"


@dataclass(frozen=True)
class ToolCallRecord:
    """What happened to one tool call during an episode (kept for metrics)."""

    name: str  # tool name, or "<invalid>" when the call could not be parsed
    ok: bool
    error: str | None
    latency_s: float
    turn: int


@dataclass(frozen=True)
class Reward:
    """An episode's score: the value GRPO compares, and named parts logged beside it (weight-free)."""

    value: float
    parts: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Return:
    """An episode's return as its group's statistics see it (`core.returns.episode_return`)."""

    value: float  # what the advantage estimator compares: `outcome` plus `share` x the turns' own rewards
    outcome: float  # the outcome part: the episode's reward, or the truncation rule's for a truncated episode
    usable: bool = True  # False: kept out of the group's statistics (an infrastructure error, a masked truncation)
    share: float = 1.0  # what the turns' own rewards count for in `value` (the rules of `core.returns`)


# the name under which `Trajectory.reward_parts` keeps the episode's own reward once group-level rewards
# (scored over a finished group: `rollout.runner`) are added to `Trajectory.reward`
EPISODE_REWARD = "episode_reward"


class StopReason(str, enum.Enum):  # noqa: UP042  (StrEnum would change what str() of a member prints)
    """Why an episode ended."""

    NO_TOOL_CALL = "no_tool_call"  # the policy answered without calling a tool
    ENV_DONE = "env_done"  # the environment declared the episode finished
    MAX_TURNS = "max_turns"
    MAX_TOKENS = "max_tokens"  # total token budget of the episode exhausted
    LENGTH = "length"  # a sampled turn was cut by its max_tokens: truncated, nothing stitched after
    ERROR = "error"  # infrastructure error (sampler/server/environment), kept out of group statistics


@dataclass(frozen=True)
class Turn:
    """Boundaries of one sampled assistant turn, [start, end), inside the token ids of segment
    `segment` (`Trajectory.all_segments[segment]`; the trajectory's own ids when it has one), with the
    reward the environment gave that turn (`core.env.StepResult.reward`) and the state it started from."""

    start: int
    end: int
    finish_reason: str  # "stop" or "length", as the sampler reported it
    policy_version: int  # the version that sampled its first token (each token's: the segment's `versions`)
    segment: int = 0
    # the turn's own reward (0.0: none); a turn cut by its max_tokens is never stepped: a failed call's
    # (`Env.unparsed_turn_reward`)
    reward: float = 0.0
    reward_parts: dict[str, float] = field(default_factory=dict)  # its named parts, weight-free
    # the environment state the turn was sampled from (`Env.state_key`, else a hash of the rendered
    # observation): turns of a group with the same key form GiGPO's step groups (`learn.credit`)
    state: str = ""


def _versions(loss_mask: tuple[int, ...], version: int) -> tuple[int, ...]:
    """Every sampled token sampled by `version`; -1 elsewhere."""
    return tuple(version if m else -1 for m in loss_mask)


@dataclass(frozen=True)
class Segment:
    """One training sequence of an episode: ids, loss mask, sampler log-probs and policy versions, aligned."""

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    # the policy version that sampled each token, -1 where not sampled; () on construction: not known (-1)
    versions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.versions and self.token_ids:
            object.__setattr__(self, "versions", _versions(self.loss_mask, -1))

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)


def _check_aligned(task_id: str, seg: Segment | Trajectory, which: str) -> None:
    n = len(seg.token_ids)
    if len(seg.loss_mask) != n or len(seg.logprobs) != n or len(seg.versions) != n:
        raise ValueError(
            f"trajectory {task_id}{which}: token_ids ({n}), loss_mask ({len(seg.loss_mask)}), "
            f"logprobs ({len(seg.logprobs)}) and versions ({len(seg.versions)}) must have the same length"
        )


@dataclass(frozen=True)
class Branch:
    """Where a branch episode leaves episode `source` of its group (`rollout.branching`): the source's sampled ids of
    turns 0 .. t - 1 replayed as they were (`replies`), the first ids of turn t kept (`kept`), then `forced` ids given
    (the opening of a call), none of them sampled: the policy samples the rest. Every given id is context (mask 0):
    the shared prefix is trained once, in the source's row."""

    source: int  # the index of the source episode in its group (-1: none, a forced first turn: `bootstrap`)
    replies: tuple[tuple[int, ...], ...]  # the source's sampled ids of each turn before the branch
    kept: tuple[int, ...]  # the source's first ids of the branch's turn
    forced: tuple[int, ...] = ()  # given after them, not sampled (the opening of a call)

    @property
    def turn(self) -> int:
        """The turn the branch leaves its source at."""
        return len(self.replies)

    @property
    def head(self) -> tuple[int, ...]:
        """The given ids the branch's turn starts with: the kept ones, then the forced ones."""
        return self.kept + self.forced


@dataclass(frozen=True)
class Trajectory:
    """One finished episode, token-exact."""

    task_id: str
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    prompt_len: int  # tokens of the initial prompt
    turns: tuple[Turn, ...]
    messages: tuple[Message, ...]
    tool_calls: tuple[ToolCallRecord, ...]
    stop_reason: StopReason
    reward: float = 0.0
    reward_parts: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # infrastructure error message when stop_reason == ERROR
    policy_version: int = 0  # the oldest policy version that sampled any turn
    reward_s: float = 0.0  # seconds spent scoring this episode (env.reward)
    segments: tuple[Segment, ...] = ()  # earlier closed segments, oldest first (module doc)
    env: str = ""  # the environment that played it, in a run of several (the task's "env" tag)
    # the policy version that sampled each token of `token_ids`, -1 where not sampled; () on construction:
    # every sampled token is `policy_version`'s
    versions: tuple[int, ...] = ()
    # an ERROR whose cause was the episode's server dying under one of its requests (the sampler's `ServerLost`):
    # not the episode's failure, the stream plays it again; a field, so that it travels from a rollout worker
    server_lost: bool = False
    # with an error, the type it is counted under: the exception's class name where it was caught, "group_reward"
    # for a group reward that failed (`rollout.engine.Failures`)
    error_type: str = ""
    # the return its group's statistics compare, set once its group has ended (`core.returns`); None: not yet
    ret: Return | None = None
    # a branch of another episode of its group (`rollout.branching`); None: one of the group's own G episodes
    branch: Branch | None = None
    # the names of the tools the episode offered the policy (its environment's at the start, then any it offered by
    # the end), what a call naming another is counted against (`runs.metrics.violation_metrics`); None: not recorded
    tools: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.versions and self.token_ids:
            object.__setattr__(self, "versions", _versions(self.loss_mask, self.policy_version))
        _check_aligned(self.task_id, self, "")
        for k, seg in enumerate(self.segments):
            _check_aligned(self.task_id, seg, f" segment {k}")

    @property
    def all_segments(self) -> tuple[Segment, ...]:
        """Every training sequence of the episode, the current one (the trajectory's own ids) last."""
        return (*self.segments, Segment(self.token_ids, self.loss_mask, self.logprobs, self.versions))

    @property
    def infra_error(self) -> bool:
        return self.stop_reason is StopReason.ERROR

    @property
    def truncated(self) -> bool:
        return self.stop_reason in (StopReason.LENGTH, StopReason.MAX_TOKENS)

    @property
    def num_sampled(self) -> int:
        """Sampled tokens of every segment."""
        return sum(self.loss_mask) + sum(seg.num_sampled for seg in self.segments)

    @property
    def num_tokens(self) -> int:
        """Tokens of every segment (a context repeated in a later segment counts again)."""
        return len(self.token_ids) + sum(len(seg.token_ids) for seg in self.segments)

    @property
    def used_tools(self) -> bool:
        return len(self.tool_calls) > 0

    @property
    def turn_reward(self) -> float:
        """The turns' own rewards summed (0.0 without any): `reward` is the episode's outcome alone."""
        return sum((t.reward for t in self.turns), 0.0)


@dataclass(frozen=True)
class TrajectoryGroup:
    """The G rollouts of one task: the unit over which GRPO compares rewards."""

    task_id: str
    trajectories: tuple[Trajectory, ...]
