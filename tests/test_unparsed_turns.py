"""An unparsed turn is a failed call: a turn cut at its token limit is never stepped, and the runner records what
its environment charges a failed call (`Env.unparsed_turn_reward`), by each built-in environment's own rule; none
where turn rewards are off, and nothing is run or changed by it."""

from __future__ import annotations

import pytest
from helpers import call_text as call
from test_gui_env import TASK

from agent_rl.core.types import StopReason
from agent_rl.envs.calculator import CalculatorEnv
from agent_rl.envs.calculator import load_tasks as calculator_tasks
from agent_rl.envs.gui import GuiEnv
from agent_rl.rollout.runner import EpisodeLimits, run_episode

LIMITS = EpisodeLimits(max_turns=4, max_tokens_per_turn=48, max_total_tokens=8192)
RUNS_ON = call("click", element="e" + "1" * 400)  # a call whose arguments run past the 48-token turn


async def play(scripted, renderer, env, replies):
    async with env:
        return await run_episode(env, scripted(lambda m: replies[sum(x.role == "assistant" for x in m)],
                                               on_messages=True), renderer, LIMITS, "t")


async def test_the_gui_charges_a_cut_turn_as_a_call_that_never_reached_the_page(scripted, renderer):
    env = GuiEnv({**TASK, "turn_rewards": True})
    traj = await play(scripted, renderer, env, [call("click", element="e51"), RUNS_ON])
    assert traj.stop_reason is StopReason.LENGTH and [t.finish_reason for t in traj.turns] == ["stop", "length"]
    # by hand: Dark mode clicked (not saved: 0), then the cut turn: one call that never reached the page
    assert [(t.reward, t.reward_parts) for t in traj.turns] == [
        (0.0, {"saved": 0.0, "idle_save": 0.0, "refused": 0.0, "bad_call": 0.0}),
        (-0.1, {"saved": 0.0, "idle_save": 0.0, "refused": 0.0, "bad_call": -0.1})]
    assert env.actions == 1 and env.invalid_actions == 0  # nothing ran on the page for the cut turn
    assert [r.name for r in traj.tool_calls] == ["click"]  # and no call is recorded for it
    off = await play(scripted, renderer, GuiEnv(TASK), [RUNS_ON])  # turn rewards off: nothing charged
    assert [t.reward for t in off.turns] == [0.0]


async def test_the_calculator_charges_a_cut_turn_as_a_failed_calculator_call(scripted, renderer):
    task = {**calculator_tasks(1, seed=3)[0], "turn_rewards": True}
    traj = await play(scripted, renderer, CalculatorEnv(task), [call("calculator", expression="1" * 300)])
    assert traj.stop_reason is StopReason.LENGTH
    assert [(t.reward, t.reward_parts) for t in traj.turns] == [(pytest.approx(-0.1), {"tool_errors": -0.1})]
