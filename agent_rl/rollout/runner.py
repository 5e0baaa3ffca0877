"""The async rollout runner: play one environment turn by turn and record a token-exact trajectory.

Owns: one episode (`run_episode`: each turn's tokens, its own reward, a cut turn's a failed call's,
`unparsed_turn_reward`, and the state it started from, `state_key`; `play_task` builds its environment too); the
token buffer, loss mask and log-probs of an episode (`TokenBuffer`) and its segments (when the renderer cannot
extend the buffer, `Renderer.next_context`, or an env's replaced conversation, `StepResult.history`, renders to ids
that do not extend it); the stop rules (no tool call, env done, max turns, max total tokens, a turn cut by
`length`); the episode limits (`EpisodeLimits`); a group's group-level reward added once its episodes have ended
(`score_group`; the environment's own reward is kept as the `EPISODE_REWARD` part); the trajectory of an episode
that failed before it began (`failed_episode`); the deadline of every await on an environment (`bounded`).
Does not own: rendering and parsing (`core.renderers`), HTTP (`rollout.sampler`), tools (`envs`), rewards beyond
asking the env, the seeds (`core.seeds`), garbage collection while a rollout runs (`rollout.quiet_gc`), playing
groups of episodes (`rollout.engine`) and where they play (`rollout.players`).

Failures are data: a sampler or environment exception ends that episode with StopReason.ERROR, the message in
`Trajectory.error` and the exception's class name in `Trajectory.error_type`; the other episodes go on. A group
reward that fails makes its group's trajectories infrastructure errors (kept out of the update), with the reason.

A task's "id" names it; its "env", where a mixture of environments set one, goes to `Trajectory.env`.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from agent_rl.core.config import RolloutConfig
from agent_rl.core.deadline import deadline
from agent_rl.core.env import Env, as_reward
from agent_rl.core.renderers.base import Renderer
from agent_rl.core.seeds import request_seed
from agent_rl.core.types import (
    EPISODE_REWARD,
    Branch,
    Message,
    Reward,
    Segment,
    StopReason,
    ToolCallRecord,
    Trajectory,
    Turn,
)
from agent_rl.rollout.branching import BranchSampler
from agent_rl.rollout.sampler import Sampler, SamplingParams, ServerLost

T = TypeVar("T")


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4
    max_tokens_per_turn: int = 256
    max_total_tokens: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    env_timeout_s: float = 120.0  # deadline for any single environment call
    seed: int | None = None  # base of per-request sampling seeds: same seed, same rollouts

    @classmethod
    def from_config(cls, rollout: RolloutConfig, temperature: float = 1.0, top_p: float = 1.0,
                    seed: int | None = None) -> EpisodeLimits:
        """The limits a `RolloutConfig` sets, at a sampling temperature (training's or evaluation's)."""
        return cls(max_turns=rollout.max_turns, max_tokens_per_turn=rollout.max_tokens_per_turn,
                   max_total_tokens=rollout.max_total_tokens, temperature=temperature, top_p=top_p, seed=seed)






@dataclass
class TokenBuffer:
    """The episode's ids, and what is aligned one to one with them (loss mask, log-probs, policy versions) as the
    runs that were added; within a segment it only ever grows, so every prompt extends the previous prompt plus its
    samples. `new_segment` closes it and starts over (the renderer's fresh context follows); the sampler's context
    is the open segment.

    Only the ids are one list while the episode plays: they are the next prompt. The mask, log-probs and versions
    are written out once, when the segment closes (`segment`), rather than grown as lists turn by turn (its cost:
    docs/performance.md, bench/turn_parts.py)."""

    ids: list[int] = field(default_factory=list)
    # each added run: its length, and for a sampled one its log-probs and versions (None: context)
    runs: list[tuple[int, Sequence[float] | None, Sequence[int] | None]] = field(default_factory=list)
    closed: list[Segment] = field(default_factory=list)

    def new_segment(self) -> None:
        self.closed.append(self.segment())
        self.ids, self.runs = [], []

    def add_context(self, ids: Sequence[int]) -> None:
        self.ids.extend(ids)
        self.runs.append((len(ids), None, None))

    def add_sampled(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(f"{len(ids)} sampled ids but {len(logprobs)} log-probs and {len(versions)} versions")
        self.ids.extend(ids)
        self.runs.append((len(ids), logprobs, versions))

    def segment(self) -> Segment:
        """The open segment: its ids, and its mask, log-probs and versions written out from the runs."""
        mask: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        for n, sampled, sampled_versions in self.runs:
            if sampled is None or sampled_versions is None:
                mask += [0] * n
                logprobs += [0.0] * n
                versions += [-1] * n
            else:
                mask += [1] * n
                logprobs += sampled
                versions += sampled_versions
        return Segment(tuple(self.ids), tuple(mask), tuple(logprobs), tuple(versions))


@dataclass
class _Episode:
    """What one episode accumulates while it is played."""

    buffer: TokenBuffer = field(default_factory=TokenBuffer)
    turns: list[Turn] = field(default_factory=list)
    records: list[ToolCallRecord] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    stop: StopReason = StopReason.MAX_TURNS
    prompt_len: int = 0
    server_lost: bool = False  # a request of its own met its server's death (`Trajectory.server_lost`)


async def _play_turns(env: Env, sampler: Sampler, renderer: Renderer, limits: EpisodeLimits,
                      ep: _Episode, task_id: str, rollout_index: int) -> None:
    """Sample and step until a stop rule fires; fills `ep`. Raises on sampler or env failures."""
    buf = ep.buffer
    observation = tuple(buf.ids)  # what the policy sees before turn 0: the rendered prompt
    for turn in range(limits.max_turns):
        budget = min(limits.max_tokens_per_turn, limits.max_total_tokens - len(buf.ids))
        if budget <= 0:
            ep.stop = StopReason.MAX_TOKENS
            return
        state = await state_key(env, observation, limits.env_timeout_s)
        seed = None if limits.seed is None else request_seed(limits.seed, task_id, rollout_index, turn)
        params = SamplingParams(max_tokens=budget, temperature=limits.temperature, top_p=limits.top_p,
                                stop_token_ids=tuple(renderer.stop_token_ids), seed=seed)
        try:  # the vLLM sampler also checks that the server echoed these ids unchanged
            out = await sampler.sample(buf.ids, params, messages=tuple(ep.messages))  # not a copy (`Sampler`)
        except ServerLost:  # told apart here, where it is the episode's own request, not by the error's text
            ep.server_lost = True
            raise
        start = len(buf.ids)
        if out.given:  # a branch's given ids (`rollout.branching`): context, the rest sampled
            buf.add_context(out.token_ids[:out.given])
            buf.add_sampled(out.token_ids[out.given:], out.logprobs[out.given:], out.versions[out.given:])
        else:
            buf.add_sampled(out.token_ids, out.logprobs, out.versions)  # each token's version: the sampler's
        ep.turns.append(Turn(start, len(buf.ids), out.finish_reason, out.policy_version, len(buf.closed),
                             state=state))
        reply = renderer.parse(out.token_ids)
        ep.messages.append(reply)
        if out.finish_reason == "length":  # cut mid-turn: nothing is stitched after it
            ep.stop = StopReason.LENGTH if budget == limits.max_tokens_per_turn else StopReason.MAX_TOKENS
            ep.turns[-1] = rewarded(ep.turns[-1], await unparsed_turn_reward(env, turn, limits.env_timeout_s))
            return
        result = await bounded(env.step(reply, turn), limits.env_timeout_s)
        ep.turns[-1] = rewarded(ep.turns[-1], result.reward)
        ep.records.extend(result.tool_calls)
        if result.done:
            ep.stop = result.stop_reason
            return
        if turn == limits.max_turns - 1:
            return  # MAX_TURNS
        if result.history is not None:  # the env replaced the conversation: render it whole
            ep.messages = list(result.history)
            ids, fresh = renderer.extend_or_restart(ep.messages, env.tool_schemas, buf.ids)
        else:
            ep.messages.extend(result.messages)
            ended = bool(out.token_ids) and out.token_ids[-1] in renderer.stop_token_ids
            ids, fresh = renderer.next_context(ep.messages, result.messages, env.tool_schemas, buf.ids, ended)
        if fresh:  # the template rewrote history: train on what was sampled so far, go on from the new render
            buf.new_segment()
        buf.add_context(ids)
        observation = tuple(ids)


async def state_key(env: Env, observation: tuple[int, ...], timeout_s: float) -> str:
    """The state a turn starts from: the environment's own key (`Env.state_key`), else a hash of the
    observation's token ids (the context rendered since the last sampled turn, the prompt before the first)."""
    own = getattr(env, "state_key", None)  # an object that only quacks like an `Env` may lack it
    key = None
    if own is not None and getattr(type(env), "state_key", None) is not Env.state_key:  # the default says None
        key = await bounded(own(), timeout_s)
    return observation_key(observation) if key is None else str(key)


async def unparsed_turn_reward(env: Env, turn: int, timeout_s: float) -> float | Reward | None:
    """What the environment charges a turn cut at its token limit (`Env.unparsed_turn_reward`: a failed call's);
    None from an object that only quacks like an `Env` and lacks it."""
    own = getattr(env, "unparsed_turn_reward", None)
    return None if own is None else await bounded(own(turn), timeout_s)


@functools.lru_cache(maxsize=1024)
def observation_key(observation: tuple[int, ...]) -> str:
    """A stable hash of token ids. Cached: every rollout of a task starts from the same rendered prompt (its cost:
    docs/performance.md#smaller-measurements), and a group's tool results often repeat."""
    return hashlib.blake2b(",".join(map(str, observation)).encode(), digest_size=8).hexdigest()


async def bounded(awaitable: Awaitable[T], timeout_s: float) -> T:
    """`await awaitable` with a deadline (TimeoutError past it, up to 1/32 of it late: `core.deadline`, which
    costs less than asyncio.timeout's timer per call). A context manager rather than `wait_for`: no task of its own
    per call, and a cancellation of the episode is never swallowed (3.11's wait_for can)."""
    async with deadline(timeout_s):
        return await awaitable


def rewarded(turn: Turn, reward: float | Reward | None) -> Turn:
    """The turn with the reward the environment gave it (`StepResult.reward`; None: none)."""
    if reward is None:
        return turn
    r = as_reward(reward)
    return replace(turn, reward=r.value, reward_parts=dict(r.parts))


async def run_episode(env: Env, sampler: Sampler, renderer: Renderer, limits: EpisodeLimits,
                      task_id: str = "", rollout_index: int = 0) -> Trajectory:
    """Play one episode in an entered env. Never raises for sampler or env failures."""
    ep = _Episode()
    error, error_type, reward, reward_s = None, "", Reward(0.0), 0.0
    tools: tuple[str, ...] | None = None
    try:
        ep.messages = list(await bounded(env.initial_messages(), limits.env_timeout_s))
        ep.buffer.add_context(renderer.render(ep.messages, env.tool_schemas))
        ep.prompt_len = len(ep.buffer.ids)
        tools = tool_names(env.tool_schemas)
        await _play_turns(env, sampler, renderer, limits, ep, task_id, rollout_index)
        tools = tuple(dict.fromkeys((*tools, *tool_names(env.tool_schemas))))
        t_reward = time.perf_counter()
        reward = as_reward(await bounded(env.reward(ep.messages), limits.env_timeout_s))
        reward_s = time.perf_counter() - t_reward
    except Exception as e:  # infrastructure: sampler down, env bug, deadline
        ep.stop, error = StopReason.ERROR, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        reward, error_type = Reward(0.0), type(e).__name__
    versions = [t.policy_version for t in ep.turns]
    buf = ep.buffer
    last = buf.segment()
    return Trajectory(
        task_id=task_id, token_ids=last.token_ids, loss_mask=last.loss_mask, logprobs=last.logprobs,
        prompt_len=ep.prompt_len, turns=tuple(ep.turns), messages=tuple(ep.messages),
        tool_calls=tuple(ep.records), stop_reason=ep.stop, reward=reward.value, reward_parts=dict(reward.parts),
        error=error, policy_version=min(versions) if versions else sampler.policy_version, reward_s=reward_s,
        segments=tuple(buf.closed), versions=last.versions, server_lost=ep.server_lost, error_type=error_type,
        tools=tools,
    )


def tool_names(schemas: Sequence[dict[str, Any]]) -> tuple[str, ...]:
    """The names of OpenAI-style tool schemas (`{"type": "function", "function": {"name": ...}}`, or the bare
    function), in order."""
    return tuple(str(s.get("function", s).get("name", "")) for s in schemas)


async def play_task(task: dict[str, Any], index: int, make_env: Callable[[dict[str, Any]], Env], sampler: Sampler,
                    renderer: Renderer, limits: EpisodeLimits, branch: Branch | None = None) -> Trajectory:
    """Rollout `index` of `task` in an environment of its own; never raises for the env's or sampler's failures.
    With `branch`, a branch of another episode of its group (`rollout.branching`), marked as one."""
    task_id = str(task.get("id", ""))
    try:
        env = make_env(task)
        async with env:
            played = sampler if branch is None else BranchSampler(sampler, branch)
            traj = await run_episode(env, played, renderer, limits, task_id, index)
            if branch is not None:
                traj = replace(traj, branch=branch)
    except Exception as e:  # the env could not even be built or entered
        return failed_episode(task, f"environment could not start: {type(e).__name__}: {e}", type(e).__name__,
                              sampler.policy_version)
    return replace(traj, env=task["env"]) if isinstance(task.get("env"), str) else traj


async def score_group(hook: Callable[..., Any], task: dict[str, Any], trajs: Sequence[Trajectory],
                      timeout_s: float) -> list[Trajectory]:
    """Add `hook`'s reward for each finished trajectory (those without an infra error) to its own."""
    done = [t for t in trajs if not t.infra_error]
    if not done:
        return list(trajs)
    try:
        out = hook(task, tuple(done))
        out = await asyncio.wait_for(out, timeout_s) if inspect.isawaitable(out) else out
        if out is None:
            return list(trajs)
        rewards = [as_reward(r) for r in out]
        if len(rewards) != len(done):
            raise ValueError(f"{len(rewards)} rewards for {len(done)} trajectories")
    except Exception as e:  # a bug or an outage: the group cannot be scored, so it is not trained on
        why = f"group reward failed: {type(e).__name__}: {e}" if str(e) else f"group reward failed: {type(e).__name__}"
        return [t if t.infra_error else replace(t, stop_reason=StopReason.ERROR, error=why, error_type="group_reward")
                for t in trajs]
    scored = iter(rewards)
    return [t if t.infra_error else _plus(t, next(scored)) for t in trajs]


def _plus(t: Trajectory, r: Reward) -> Trajectory:
    parts = {EPISODE_REWARD: t.reward_parts.get(EPISODE_REWARD, t.reward), **t.reward_parts, **r.parts}
    return replace(t, reward=t.reward + r.value, reward_parts=parts)


def failed_episode(task: dict[str, Any], error: str, error_type: str, version: int) -> Trajectory:
    """The trajectory of an episode of `task` that failed before it played a turn (its environment would not start,
    its rollout worker died or hung: `rollout.ray_pool`)."""
    env = task["env"] if isinstance(task.get("env"), str) else ""
    return Trajectory(task_id=str(task.get("id", "")), token_ids=(), loss_mask=(), logprobs=(), prompt_len=0,
                      turns=(), messages=(), tool_calls=(), stop_reason=StopReason.ERROR, error=error,
                      error_type=error_type, policy_version=version, env=env)
