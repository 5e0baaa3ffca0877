"""An episode's return: the one number its group compares, made once from the outcome, the turns and the rules.

Owns: `episode_return` (the outcome, or the truncation rule's reward for a truncated episode, plus the turns' own
rewards; an infrastructure error, or a truncation the rule masks, kept out of the group's statistics) and
`scored` (a group's trajectories with their returns set, as the rollout engine stores them once a group has ended).
Does not own: the rewards themselves (`core.env`, the environments, group rewards: `rollout.runner.score_group`),
what is done with a return (`learn.advantages`, `learn.credit`, `runs.metrics`).

The truncation rule (`algorithm.truncated_reward`): None leaves truncated episodes out of their group's statistics
and the loss (DAPO's overlong filtering: the episode never got to answer, so its reward is evidence of nothing); a
number keeps them in with that number as their outcome. Turn rewards are added in either case they are kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from agent_rl.core.types import Return, Trajectory

LEFT_OUT = Return(0.0, 0.0, usable=False)


def episode_return(traj: Trajectory, truncated_reward: float | None = None) -> Return:
    """`traj`'s return under the truncation rule `truncated_reward` (module doc)."""
    if traj.infra_error:
        return LEFT_OUT
    outcome = float(traj.reward)
    if traj.truncated:
        if truncated_reward is None:
            return LEFT_OUT
        outcome = float(truncated_reward)
    return Return(outcome + traj.turn_reward, outcome)


def scored(trajs: Iterable[Trajectory], truncated_reward: float | None = None) -> tuple[Trajectory, ...]:
    """Each trajectory with its return set (`Trajectory.ret`)."""
    return tuple(replace(t, ret=episode_return(t, truncated_reward)) for t in trajs)
