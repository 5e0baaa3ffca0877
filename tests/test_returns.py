"""The return rules (`core.returns`), worked out by hand: turn rewards count as shares of the outcome (a failure's
penalties never rank it, a success is never worth less than a failure), a truncated episode scores at most its
group's lowest honest value and below it by its cut turn (an unparsed turn is a failed call); and, for every credit
rule, estimator and discount, an episode whose last turn was cut never gets a higher advantage, at any turn, than
the same episode whose last turn was a failed call."""

from __future__ import annotations

import pytest

from agent_rl.core.returns import episode_return, scored, turn_share
from agent_rl.core.types import Return, StopReason, Trajectory, TrajectoryGroup, Turn
from agent_rl.learn.advantages import ESTIMATORS, group_advantages
from agent_rl.learn.credit import CREDITS, TurnCredit

FAILED_CALL = -0.1  # what every built-in environment with turn rewards charges a failed call (envs.base)


def episode(rewards: list[float], outcome: float, stop: StopReason = StopReason.NO_TOOL_CALL,
            states: list[str] | None = None, name: str = "t") -> Trajectory:
    """len(rewards) turns; a truncated episode's last turn is the one its token limit cut (finish "length")."""
    states = states or [""] * len(rewards)
    cut = stop in (StopReason.LENGTH, StopReason.MAX_TOKENS)
    turns = tuple(Turn(1, 1, "length" if cut and t == len(rewards) - 1 else "stop", 0, reward=r, state=s)
                  for t, (r, s) in enumerate(zip(rewards, states)))
    return Trajectory(name, (), (), (), 0, turns, (), (), stop, reward=outcome)


@pytest.mark.parametrize(("rewards", "outcome", "expected"), [
    ([0.0, -0.1, -0.1], 1.0, Return(0.8, 1.0, share=1.0)),  # a success pays its penalties in full
    ([-0.1, -0.1], 0.0, Return(0.0, 0.0, share=0.0)),  # a failure's count for nothing
    ([0.1, -0.1], 0.0, Return(0.0, 0.0, share=0.0)),  # a save undone: nothing, as anywhere
    ([0.3], 0.0, Return(0.0, 0.0, share=0.0)),  # a reward in a failure counts nothing either
    ([-0.2], 0.5, Return(0.4, 0.5, share=0.5)),  # a graded outcome: k = 0.5, 0.5 - 0.1
    ([-0.5, -1.0], 1.0, Return(0.0, 1.0, share=1 / 1.5)),  # costs past the outcome: k = 1 / 1.5, the value 0
    ([-0.2], -1.0, Return(-1.0, -1.0, share=0.0)),  # an outcome below 0: k = 0, the turns count nothing
    ([], 1.0, Return(1.0, 1.0, share=1.0)),
])
def test_turn_rewards_are_shares_of_the_outcome(rewards, outcome, expected):
    ret = episode_return(episode(rewards, outcome))
    assert (ret.value, ret.outcome, ret.share, ret.usable) == pytest.approx(
        (expected.value, expected.outcome, expected.share, True), abs=1e-15)
    assert ret.share == turn_share(outcome, rewards)


def test_a_success_is_the_outcome_and_its_turns_bit_for_bit():
    ret = episode_return(episode([0.1, -0.3, 0.0], 1.0))
    assert ret == Return(1.0 + (0.1 - 0.3), 1.0)  # as before the rules: no rounding of their own


def values(group: list[Trajectory], truncated_reward: float | None) -> list[float | None]:
    return [t.ret.value if t.ret.usable else None for t in scored(group, truncated_reward)]


def test_a_truncated_episode_scores_below_its_groups_lowest_honest_value():
    success, failure = episode([-0.1, 0.0], 1.0, name="s"), episode([-0.1, -0.1], 0.0, name="f")
    cut = episode([-0.3, FAILED_CALL], 1.0, StopReason.LENGTH, name="cut")  # its env said 1: it never ended
    spent = episode([0.0], 1.0, StopReason.MAX_TOKENS, name="spent")  # its budget ran out between turns
    error = episode([], -5.0, StopReason.ERROR, name="e")
    # the lowest honest value is the failure's 0: cut 0 - 0.1, spent 0 (no turn was cut); the error stays out
    assert values([success, failure, cut, spent, error], 0.0) == [0.9, 0.0, -0.1, 0.0, None]
    [*_, ret_cut, _, _] = [t.ret for t in scored([success, failure, cut, spent, error], 0.0)]
    assert ret_cut == Return(-0.1, -0.1, share=0.0)  # its turns count nothing: the cut one's charge is its outcome's
    # a higher truncated_reward never lifts it above the honest ones; a lower one stays
    assert values([success, failure, cut], 0.5) == [0.9, 0.0, -0.1]
    assert values([success, failure, cut], -1.0) == [0.9, 0.0, -1.1]
    # no failure in the group: the rule's own number (0) is the bound; every episode cut: nothing to compare with
    assert values([success, cut], 0.0) == [0.9, -0.1]
    assert values([cut, spent], 0.0) == [-0.1, 0.0]
    # an environment whose failures score -1: the truncation follows them down
    assert values([success, episode([0.0], -1.0), cut], 0.0) == [0.9, -1.0, -1.1]
    assert values([success, failure, cut], None) == [0.9, 0.0, None]  # None: masked, as before


def turn_summary(adv, name: str) -> tuple[float, list[float]]:
    i = [t.task_id for t in adv.trajectories].index(name)
    turns = adv.turn_advantages[i] if adv.turn_advantages is not None else \
        (adv.advantages[i],) * len(adv.trajectories[i].turns)
    return adv.advantages[i], list(turns)


PREFIXES = [[], [0.0], [-0.1], [-0.1, -0.1, 0.0], [0.0, 0.3]]  # what the two episodes did before their last turn


@pytest.mark.parametrize("credit", sorted(CREDITS))
@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_a_cut_turn_never_outranks_a_failed_call(credit, estimator, gamma):
    """In a group of a success, a do-nothing failure and, for each prefix, the same episode ending in a failed call
    (F) or in a turn cut at the token limit (T), both from the same states: T's episode advantage and every turn's
    advantage are at most F's, whatever the credit rule, estimator and discount."""
    settings = {"gamma": gamma} if "gamma" in CREDITS[credit].reads else {}
    rule = None if CREDITS[credit].assign is None else TurnCredit(credit, estimator, **settings)
    for k, prefix in enumerate(PREFIXES):
        states = [f"s{t}" for t in range(len(prefix) + 1)]
        group = [episode([0.0, 0.0], 1.0, states=["s0", "win"], name="S"),
                 episode([0.0], 0.0, states=["s0"], name="D"),
                 episode([*prefix, FAILED_CALL], 0.0, StopReason.MAX_TURNS, states, name="F"),
                 episode([*prefix, FAILED_CALL], 0.0, StopReason.LENGTH, states, name="T")]
        adv = group_advantages([TrajectoryGroup("q", scored(group, 0.0))], ESTIMATORS[estimator].advantages, rule)
        f_episode, f_turns = turn_summary(adv, "F")
        t_episode, t_turns = turn_summary(adv, "T")
        assert t_episode < f_episode, (k, adv)
        assert all(a <= b + 1e-12 for a, b in zip(t_turns, f_turns)), (k, t_turns, f_turns)
