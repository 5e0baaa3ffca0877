"""The async rollout runner: play environments turn by turn and record token-exact trajectories.

Owns: one episode (`run_episode`) and G episodes per task for a batch of tasks, concurrently under a
cap (`rollout_groups`). Builds the token buffer, loss mask and log-probs; enforces the stop rules
(no tool call, env done, max turns, max total tokens, a turn cut by `length`).
Does not own: rendering (`chat`), HTTP (`sampler`), tools (`envs`), rewards beyond asking the env.

Failures are data: a sampler or environment exception ends that episode with StopReason.ERROR and
the message in `Trajectory.error`; the other episodes go on.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from agent_rl.chat import ChatRenderer
from agent_rl.sampler import Sampler, SamplingParams
from agent_rl.types import Message, StopReason, ToolCallRecord, Trajectory, TrajectoryGroup, Turn
from envs.base import Env


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4
    max_tokens_per_turn: int = 256
    max_total_tokens: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    env_timeout_s: float = 120.0  # deadline for any single environment call
    seed: int | None = None  # base of per-request sampling seeds: same seed, same rollouts


def request_seed(base: int, task_id: str, rollout_index: int, turn: int) -> int:
    """A stable 31-bit seed per (base, task, rollout, turn): Python's hash() is salted per process."""
    digest = hashlib.blake2b(f"{base}|{task_id}|{rollout_index}|{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


async def run_episode(env: Env, sampler: Sampler, renderer: ChatRenderer, limits: EpisodeLimits,
                      task_id: str = "", rollout_index: int = 0) -> Trajectory:
    """Play one episode in an entered env. Never raises for sampler or env failures."""
    ids: list[int] = []
    mask: list[int] = []
    logps: list[float] = []
    turns: list[Turn] = []
    records: list[ToolCallRecord] = []
    messages: list[Message] = []
    stop, error = StopReason.MAX_TURNS, None
    prompt_len, reward_s = 0, 0.0

    def extend(new: Sequence[int], sampled: bool, lp: Sequence[float] = ()) -> None:
        ids.extend(new)
        mask.extend([1 if sampled else 0] * len(new))
        logps.extend(lp if sampled else [0.0] * len(new))

    try:
        messages = list(await asyncio.wait_for(env.initial_messages(), limits.env_timeout_s))
        extend(renderer.render(messages, env.tool_schemas), sampled=False)
        prompt_len = len(ids)
        for turn in range(limits.max_turns):
            budget = min(limits.max_tokens_per_turn, limits.max_total_tokens - len(ids))
            if budget <= 0:
                stop = StopReason.MAX_TOKENS
                break
            params = SamplingParams(max_tokens=budget, temperature=limits.temperature, top_p=limits.top_p,
                                    stop_token_ids=tuple(renderer.stop_token_ids),
                                    seed=None if limits.seed is None else
                                    request_seed(limits.seed, task_id, rollout_index, turn))
            # the buffer only ever grows, so every prompt extends the previous prompt plus its samples
            # (the vLLM sampler also checks the server echoed these ids unchanged)
            out = await sampler.sample(list(ids), params)
            start = len(ids)
            extend(out.token_ids, sampled=True, lp=out.logprobs)
            turns.append(Turn(start, len(ids), out.finish_reason, out.policy_version))
            reply = Message("assistant", renderer.decode(out.token_ids))
            messages.append(reply)
            if out.finish_reason == "length":  # cut mid-turn: nothing is stitched after it
                stop = StopReason.LENGTH if budget == limits.max_tokens_per_turn else StopReason.MAX_TOKENS
                break
            result = await asyncio.wait_for(env.step(reply, turn), limits.env_timeout_s)
            records.extend(result.tool_calls)
            if result.done:
                stop = result.stop_reason
                break
            if turn == limits.max_turns - 1:
                stop = StopReason.MAX_TURNS
                break
            messages.extend(result.messages)
            ended = bool(out.token_ids) and out.token_ids[-1] in renderer.stop_token_ids
            extend(renderer.continuation(result.messages, after_stop=ended), sampled=False)
        t_reward = time.perf_counter()
        reward = float(await asyncio.wait_for(env.reward(messages), limits.env_timeout_s))
        reward_s = time.perf_counter() - t_reward
        parts = env.reward_parts()
    except Exception as e:  # infrastructure: sampler down, env bug, deadline
        stop, error = StopReason.ERROR, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        reward, parts = 0.0, {}
    versions = [t.policy_version for t in turns]
    return Trajectory(
        task_id=task_id, token_ids=tuple(ids), loss_mask=tuple(mask), logprobs=tuple(logps),
        prompt_len=prompt_len, turns=tuple(turns), messages=tuple(messages), tool_calls=tuple(records),
        stop_reason=stop, reward=reward, reward_parts=parts, error=error,
        policy_version=min(versions) if versions else sampler.policy_version, reward_s=reward_s,
    )


async def rollout_groups(tasks: Sequence[dict[str, Any]], make_env: Callable[[dict[str, Any]], Env],
                         sampler: Sampler, renderer: ChatRenderer, limits: EpisodeLimits,
                         group_size: int, max_concurrent: int = 64) -> list[TrajectoryGroup]:
    """G episodes per task, all tasks at once, at most `max_concurrent` episodes alive."""
    gate = asyncio.Semaphore(max_concurrent)

    async def one(task: dict[str, Any], index: int) -> Trajectory:
        task_id = str(task.get("id", ""))
        async with gate:
            try:
                env = make_env(task)
                async with env:
                    return await run_episode(env, sampler, renderer, limits, task_id, index)
            except Exception as e:  # the env could not even be built or entered
                return _failed(task_id, f"environment could not start: {type(e).__name__}: {e}",
                               sampler.policy_version)

    per_task = [[one(task, j) for j in range(group_size)] for task in tasks]
    flat = await asyncio.gather(*(c for group in per_task for c in group))
    return [TrajectoryGroup(str(task.get("id", "")), tuple(flat[i * group_size:(i + 1) * group_size]))
            for i, task in enumerate(tasks)]


def _failed(task_id: str, error: str, version: int) -> Trajectory:
    return Trajectory(task_id=task_id, token_ids=(), loss_mask=(), logprobs=(), prompt_len=0, turns=(),
                      messages=(), tool_calls=(), stop_reason=StopReason.ERROR, error=error,
                      policy_version=version)
