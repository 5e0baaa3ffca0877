"""What many tests share: factories of the project's nouns and small stand-ins, written once.

Owns: `here` (episodes played in this process by a scripted sampler, as `trainer.loop` takes them), `scored_groups`
(hand-built groups with their returns set, as advantages read them).
"""

from __future__ import annotations

from agent_rl.core.returns import scored
from agent_rl.core.types import TrajectoryGroup
from agent_rl.rollout.players import LocalPlayers


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
