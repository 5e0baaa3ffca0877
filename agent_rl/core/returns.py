"""An episode's return: the one number its group compares, made once from the outcome, the turns and the rules.

Owns: `episode_return` (the episode's value under the rules below, as its turns' own rewards plus the part paid at
its end; an infrastructure error, or a truncation the rule masks, kept out of the group's statistics), `turn_share`
(what the turns' rewards count for) and `scored` (a group's trajectories with their returns set, as the rollout
engine stores them once a group has ended: the truncation rule reads the group).
Does not own: the rewards themselves (`core.env`, the environments, group rewards: `rollout.runner.score_group`;
the reward of a turn cut at its token limit: `Env.unparsed_turn_reward`), what is done with a return
(`learn.advantages`, `learn.credit`, `runs.metrics`).

The rules, so that no return ranks doing less, or running out of tokens, above trying (docs/credit.md#the-rules):

1. Turn rewards are shares of the outcome. An episode's value is R + k sum_t r_t, k = the outcome R (at least 0):
   the turns' rewards count in full for a success (R = 1), not at all for a failure (R = 0). So two failures are
   never told apart by what their turns cost (ranking failures by their penalties made acting less, or nothing, the
   cheapest return), and a success is worth less for each wasted action but never less than a failure (where
   1 + sum r < 0, k shrinks to R / -sum r: the value is then 0). An environment whose failures should be told
   apart needs a graded outcome.
2. A truncated episode scores below the cheapest honest failure. `algorithm.truncated_reward`: None leaves
   truncated episodes out of their group's statistics and the loss (DAPO's overlong filtering: the episode never got
   to answer, so its reward is evidence of nothing); a number is their outcome, but never above the lowest value of
   an episode of the same group that ended on its own, whatever the penalties are; their turns count nothing but
   the one the token limit cut, charged as a failed call (an unparsed turn is a failed call: the runner asks the
   environment, `Env.unparsed_turn_reward`). So a truncation ties the worst honest episode at best, and is below it
   by a failed call where the environment charges one.

What credit per turn makes of it (`learn.credit.turn_returns`): the turns' rewards are paid as they were given, and
what the rules count differently is settled at the episode's end, when the outcome is known; so a turn's return from
itself on is the episode's value less what the turns before it were paid, which its action could not change, and
credit per turn stays an unbiased policy gradient of the value. A truncated episode counts its turns for nothing
(`Return.share` 0): its cut turn's charge is in its outcome.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from agent_rl.core.types import Return, Trajectory

LEFT_OUT = Return(0.0, 0.0, usable=False)


def turn_share(outcome: float, rewards_T: Sequence[float]) -> float:
    """k, what the turns' rewards count for (rule 1): the outcome (0 below 0), shrunk where the turns' costs
    would take the value below a failure's 0."""
    k = max(outcome, 0.0)
    total = sum(rewards_T, 0.0)
    return k / -total if total < -1.0 else k


def episode_return(traj: Trajectory, truncated_reward: float | None = None, floor: float | None = None) -> Return:
    """`traj`'s return under the rules (module doc); `floor`: the lowest value of its group's episodes that ended on
    their own (None: it has none), which a truncated episode's outcome never exceeds."""
    if traj.infra_error:
        return LEFT_OUT
    rewards_T = [t.reward for t in traj.turns]
    if traj.truncated:
        if truncated_reward is None:
            return LEFT_OUT
        outcome = float(truncated_reward) if floor is None else min(float(truncated_reward), floor)
        if traj.turns and traj.turns[-1].finish_reason == "length":  # the turn the limit cut (a budget spent
            outcome += rewards_T[-1]  # between turns cut none): charged as a failed call, as the runner recorded it
        return Return(outcome, outcome, share=0.0)
    outcome = float(traj.reward)
    k = turn_share(outcome, rewards_T)
    return Return(outcome + k * sum(rewards_T, 0.0), outcome, share=k)  # k = 1: as before the rules, bit for bit


def scored(trajs: Iterable[Trajectory], truncated_reward: float | None = None) -> tuple[Trajectory, ...]:
    """Each trajectory of one group with its return set (`Trajectory.ret`): those that ended on their own first, then
    the truncated ones, whose outcome their lowest value bounds."""
    trajs = tuple(trajs)
    honest = {id(t): episode_return(t) for t in trajs if not (t.truncated or t.infra_error)}
    floor = min((r.value for r in honest.values()), default=None)
    return tuple(replace(t, ret=honest[id(t)] if id(t) in honest else episode_return(t, truncated_reward, floor))
                 for t in trajs)
