"""What many tests share: factories of the project's nouns and small stand-ins, written once.

Owns: waits with a deadline (`until`, `until_sync`: a test waits for what it waits for, never for a guessed time);
`trajectory` (an episode written by hand, any field set by keyword); `here` (episodes played in this process by a
scripted sampler, as `trainer.loop` takes them), `scored_groups` (hand-built groups with their returns set, as
advantages read them); the sandbox cases' terms (`docker_or_skip`, `deadline_slack_s`).
Does not own: fixtures (tests/conftest.py: pytest finds them there), what one test file is about (its own file).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence

import pytest

from agent_rl.core.returns import scored
from agent_rl.core.types import Message, StopReason, ToolCallRecord, Trajectory, TrajectoryGroup, Turn
from agent_rl.rollout.players import LocalPlayers


def trajectory(reward: float = 0.0, stop: StopReason = StopReason.NO_TOOL_CALL, *, task_id: str = "t",
               ids: Sequence[int] = (), prompt_len: int | None = None, mask: Sequence[int] | None = None,
               logprobs: Sequence[float] | None = None, turns: Sequence[Turn | float] = (), states: Sequence[str] = (),
               messages: Sequence[Message] = (), calls: Sequence[ToolCallRecord] = (), **fields) -> Trajectory:
    """An episode written by hand. `ids`: the first `prompt_len` (1 where unset) the prompt, the rest sampled
    unless `mask` says otherwise, each sampled token at log-prob -0.5 unless `logprobs` says; `turns`: Turns, or
    rewards (each a turn with that reward, from the state `states` gives it); any other field by keyword."""
    prompt_len = (1 if ids else 0) if prompt_len is None else prompt_len
    mask = (0,) * prompt_len + (1,) * (len(ids) - prompt_len) if mask is None else mask
    logprobs = tuple(-0.5 if m else 0.0 for m in mask) if logprobs is None else logprobs
    states = states or [""] * len(turns)
    made = tuple(t if isinstance(t, Turn) else Turn(0, 0, "stop", 0, reward=t, state=s) for t, s in zip(turns, states))
    return Trajectory(task_id, tuple(ids), tuple(mask), tuple(logprobs), prompt_len, made, tuple(messages),
                      tuple(calls), stop, reward, **fields)


def here(run, sampler) -> LocalPlayers:
    """`run`'s episodes played in this process through `sampler`, with the run's environments and renderer."""
    return LocalPlayers(run.session.env.make_env, sampler, run.session.renderer)


def scored_groups(groups, truncated_reward=None):
    """Hand-built groups with each trajectory's return set under `truncated_reward`, as the rollout engine stores
    them once a group has ended (`core.returns.scored`)."""
    return [TrajectoryGroup(g.task_id, scored(g.trajectories, truncated_reward)) for g in groups]


def not_here(sampler, renderer) -> LocalPlayers:
    """Players for a `rollout_workers` call with workers: never asked to play here (their environment says so)."""

    def no_env(task):
        raise AssertionError("an episode played here, where the workers should have played it")

    return LocalPlayers(no_env, sampler, renderer)


# -- waits: each for a condition, with a deadline that only a failing test waits out ---------------------------
async def until(predicate: Callable[[], object], what: str, timeout_s: float = 30.0) -> None:
    """Until `predicate()` holds, polled every 5 ms; fails naming `what` after `timeout_s` (a generous bound: a
    loaded machine runs a thread, a restart or a round trip late, and a tight one would fail a right test)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"{what}: not within {timeout_s:g} s"
        await asyncio.sleep(0.005)


def until_sync(predicate: Callable[[], object], what: str, timeout_s: float = 30.0, every_s: float = 0.01) -> None:
    """`until` for a thread with no event loop (a test driving a subprocess): polled every `every_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(every_s)


# -- sandboxes ---------------------------------------------------------------------------------------------------
# .ci/run sets this once it has started a Docker daemon of its own: from then on a Docker sandbox
# case that cannot reach a daemon fails instead of skipping, so CI never passes with Docker untested.
REQUIRE_DOCKER = "AGENT_RL_REQUIRE_DOCKER"


def docker_or_skip() -> None:
    """Nothing where a Docker daemon with the sandbox image answers; else skip the calling case, or
    fail it when REQUIRE_DOCKER is set."""
    from agent_rl.tools.sandbox_docker import unavailable_reason

    if reason := unavailable_reason():
        if os.environ.get(REQUIRE_DOCKER):
            pytest.fail(f"docker unavailable although {REQUIRE_DOCKER} is set: {reason}", pytrace=False)
        pytest.skip(f"docker unavailable: {reason}")


def deadline_slack_s(backend) -> float:
    """How long past its deadline a killed sandbox call may end: the kill and clean-up, and for
    Docker also the container's start and removal, which take seconds on a loaded 2-core machine."""
    return 5.0 if backend.name == "docker" else 1.5
