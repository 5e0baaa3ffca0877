"""Turn rewards: the runner keeps each turn's own reward and start state on its turn; the built-in
environments' rules (off by default, on with `turn_rewards: true`) worked out by hand; the reward audit
with turn rewards on passes, and its hacks on turn rewards catch the naive rules they are written against;
metrics stay per rollout."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
from helpers import call_text, play_episode, trajectory
from test_gui_env import TASK

from agent_rl import cli
from agent_rl.audit.play import audit_env
from agent_rl.core.env import Env, StepResult
from agent_rl.core.registry import EnvSpec, load_env
from agent_rl.core.types import Message, Reward, StopReason, Trajectory, Turn
from agent_rl.envs.base import ToolEnv
from agent_rl.envs.calculator import CalculatorEnv
from agent_rl.envs.calculator import load_tasks as calculator_tasks
from agent_rl.envs.gui import GuiEnv, solve
from agent_rl.rollout.runner import EpisodeLimits, run_episode
from agent_rl.runs.metrics import rollout_metrics, turn_reward_metrics

LIMITS = EpisodeLimits(max_turns=12, max_total_tokens=8192)


class Counting(Env):
    """"more" gets "ok" back and costs the turn 0.25; "stop" ends the episode with a bonus part."""

    def __init__(self, own_states: bool = False):
        self.own_states, self.turns = own_states, 0

    async def initial_messages(self):
        return [Message("user", "Say more twice, then stop.")]

    async def step(self, reply, turn):
        self.turns += 1
        if reply.content.startswith("stop"):
            return StepResult(done=True, stop_reason=StopReason.NO_TOOL_CALL, reward=Reward(0.5, {"bonus": 0.5}))
        return StepResult(messages=(Message("user", "ok"),), reward=-0.25)

    async def reward(self, messages):
        return 1.0

    async def state_key(self):
        return f"after {self.turns} turns" if self.own_states else None


async def test_the_runner_keeps_each_turns_reward_and_start_state(scripted, renderer):
    replies = iter(["more", "more", "stop"])
    traj = await run_episode(Counting(), scripted(lambda text: next(replies)), renderer, LIMITS, "c")
    assert [(t.reward, t.reward_parts) for t in traj.turns] == [(-0.25, {}), (-0.25, {}), (0.5, {"bonus": 0.5})]
    assert traj.reward == 1.0 and traj.turn_reward == 0.0  # the outcome stays the episode's reward
    # the default state: a hash of the observation's ids, the prompt before turn 0, then the "ok" context
    prompt = traj.token_ids[:traj.prompt_len]
    assert traj.turns[0].state == hashlib.blake2b(",".join(map(str, prompt)).encode(), digest_size=8).hexdigest()
    assert traj.turns[1].state == traj.turns[2].state != traj.turns[0].state  # "ok" both times: the same state
    replies = iter(["more", "more", "stop"])
    own = await run_episode(Counting(own_states=True), scripted(lambda text: next(replies)), renderer, LIMITS, "c")
    assert [t.state for t in own.turns] == ["after 0 turns", "after 1 turns", "after 2 turns"]


async def test_a_turn_cut_by_its_token_budget_has_no_reward(scripted, renderer):
    limits = EpisodeLimits(max_turns=4, max_tokens_per_turn=3)
    replies = iter(["more", "more and more and more"])
    traj = await run_episode(Counting(), scripted(lambda text: next(replies)), renderer, limits, "c")
    assert traj.stop_reason is StopReason.LENGTH  # never stepped: the environment never judged it
    assert [t.reward for t in traj.turns] == [-0.25, 0.0]


# -- the built-in environments' rules --------------------------------------------------------------------
async def scripted_episode(scripted, renderer, env, script):
    """The episode of `env` whose replies are `script(messages)`."""
    return await play_episode(env, scripted(script, on_messages=True), renderer, LIMITS, "t")


def rewards_of(traj: Trajectory) -> list[tuple[float, dict[str, float]]]:
    return [(round(t.reward, 9), {k: round(v, 9) for k, v in t.reward_parts.items() if v}) for t in traj.turns]


async def test_gui_pays_each_turn_for_what_it_did_to_the_page(scripted, renderer):
    mistakes = ['<tool_call>\n{"name": "click", "arguments": {"element": "e51"}\n</tool_call>',  # bad JSON
                call_text("tap", element="e51"),  # unknown tool
                call_text("select", element="e93"),  # missing argument
                call_text("click", element="e40"),  # Save with nothing to save
                call_text("click", element="e93")]  # the wrong action for a dropdown: refused

    def script(messages):
        turn = sum(m.role == "assistant" for m in messages)
        return mistakes[turn] if turn < len(mistakes) else solve(TASK, messages, False)

    traj = await scripted_episode(scripted, renderer, GuiEnv({**TASK, "turn_rewards": True}), script)
    # by hand: three calls that never reached the page, the idle Save, the refused click; then the solver's six
    # actions, its Save of the three asked changes solving the task (0.1 each), and "done"
    assert rewards_of(traj) == [(-0.1, {"bad_call": -0.1})] * 3 + [(-0.1, {"idle_save": -0.1}),
                                                                    (-0.1, {"refused": -0.1})] + \
        [(0.0, {})] * 5 + [(0.3, {"saved": 0.3}), (0.0, {})]
    assert traj.reward == 1.0 and traj.turn_reward == pytest.approx(-0.2)
    off = await scripted_episode(scripted, renderer, GuiEnv(TASK), script)  # turn rewards off: the same episode, none
    assert [(t.reward, t.reward_parts) for t in off.turns] == [(0.0, {})] * len(off.turns)


async def test_gui_saved_is_potential_based(scripted, renderer):
    """Saving an unrelated change costs 0.1 and setting it back and saving again pays it back: the page's
    potential, never above 0 while the task is unsolved, so no cycle of saves can earn anything."""
    steps = [call_text("click", element="e29"), call_text("click", element="e40"),  # Notifications on, saved: unrelated
             call_text("click", element="e29"), call_text("click", element="e40"),  # back off, saved
             "done"]
    traj = await scripted_episode(scripted, renderer, GuiEnv({**TASK, "turn_rewards": True}),
                                  lambda m: steps[sum(x.role == "assistant" for x in m)])
    assert rewards_of(traj) == [(0.0, {}), (-0.1, {"saved": -0.1}), (0.0, {}), (0.1, {"saved": 0.1}), (0.0, {})]
    assert traj.reward == 0.0 and traj.turn_reward == 0.0


async def test_gui_state_key_is_the_pages_state():
    a, b = GuiEnv(TASK), GuiEnv(TASK)
    assert await a.state_key() == await b.state_key()  # two episodes of a task start from the same page
    await a.step(Message("assistant", "", ()), 0)  # a reply without a call changes nothing
    assert await a.state_key() == await b.state_key()
    await a.click("e51")
    assert await a.state_key() != await b.state_key()
    await b.click("e51")
    assert await a.state_key() == await b.state_key()  # the same action from the same page: the same state


async def test_calculator_charges_failed_calls(scripted, renderer):
    task = {**calculator_tasks(1, seed=3)[0], "turn_rewards": True}
    steps = [call_text("calculator", expression="2 +* 2"), call_text("calculator", expression=task["expression"]),
             f"The answer is {task['answer']}."]
    traj = await scripted_episode(scripted, renderer, CalculatorEnv(task),
                                  lambda m: steps[sum(x.role == "assistant" for x in m)])
    assert rewards_of(traj) == [(-0.1, {"tool_errors": -0.1}), (0.0, {}), (0.0, {})]
    assert traj.reward == 1.0
    assert calculator_tasks(2, seed=3, turn_rewards=True) == [{**t, "turn_rewards": True}
                                                               for t in calculator_tasks(2, seed=3)]
    with pytest.raises(ValueError, match="column 'turn_rewards' must be true or false"):
        CalculatorEnv({**task, "turn_rewards": "yes"})


@pytest.fixture(scope="module")
async def kg_url(tmp_path_factory):
    from agent_rl.tools.kg_service import KGStore, start_kg_service

    path = tmp_path_factory.mktemp("kg_turns") / "kg.sqlite"
    KGStore.build(path).close()
    async with await start_kg_service(path) as service:
        yield service.url


@pytest.mark.parametrize(("empty", "expected"), [
    # explained: the unknown entity is a tool error (failed_call); bare: an empty result (empty_lookup)
    ("explain", [(-0.1, {"failed_call": -0.1}), (-0.1, {"failed_call": -0.1}), (0.0, {}), (0.0, {})]),
    ("bare", [(-0.1, {"empty_lookup": -0.1}), (-0.1, {"failed_call": -0.1}), (0.0, {}), (0.0, {})]),
])
async def test_kg_qa_charges_a_failed_call_or_an_empty_lookup_once(kg_url, scripted, renderer, empty, expected):
    from agent_rl.envs.kg_qa import KGQAEnv
    from agent_rl.envs.kg_qa import load_tasks as kg_tasks

    task = {**kg_tasks(1, seed=0, empty_results=empty, turn_rewards=True)[0], "kg_url": kg_url}
    steps = [call_text("follow", entity="Atlantis", relation="capital"),  # no such entity
             '<tool_call>\n{"name": "follow"\n</tool_call>',  # unreadable
             call_text("follow", entity="France", relation="capital"), "<answer>no idea</answer>"]
    traj = await scripted_episode(scripted, renderer, KGQAEnv(task),
                                  lambda m: steps[sum(x.role == "assistant" for x in m)])
    assert rewards_of(traj) == expected


# -- the audit with turn rewards on -------------------------------------------------------------------------
@pytest.mark.parametrize("env", ["calculator", "kg_qa", "gui"])
async def test_the_audit_passes_with_turn_rewards_on(env, renderer):
    report = await audit_env(load_env(env).with_task_args({"turn_rewards": True}), renderer, n_tasks=3)
    assert not report.failures, report.failure_line()
    rows = {r.name: r for r in report.rows}
    assert rows["busy_calls"].max_reward <= 0.0 and rows["solver"].min_reward >= 1.0
    if env == "gui":  # the solver's return: 1 and 0.1 per asked change (levels 1, 2, 3)
        assert rows["farm_saves"].max_reward == 0.0 and rows["solver"].max_reward == pytest.approx(1.3)


class NaiveGui(GuiEnv):
    """The rule the farm is written against: +0.1 for each asked setting a Save leaves at its goal."""

    async def step(self, reply, turn):
        before, _ = await self._page("values")
        result = await ToolEnv.step(self, reply, turn)  # the calls, without GuiEnv's own turn rewards
        after, _ = await self._page("values")
        newly = sum(after[k] == v != before[k] for k, v in self.task["changes"].items())
        return StepResult(result.messages, result.done, result.stop_reason, result.tool_calls, reward=0.1 * newly)


class NaiveCalculator(CalculatorEnv):
    """The rule busy_calls is written against: +0.1 per calculator call that worked."""

    def turn_reward(self, records):
        return 0.1 * sum(r.ok for r in records)


@pytest.mark.parametrize(("env", "naive", "hack"), [("gui", NaiveGui, "farm_saves"),
                                                     ("calculator", NaiveCalculator, "busy_calls")])
async def test_the_turn_hacks_catch_the_naive_rules(env, naive, hack, renderer):
    report = await audit_env(dataclasses.replace(load_env(env), make_env=naive), renderer, n_tasks=3)
    assert hack in {r.name for r in report.failures}  # (other hacks may catch a naive rule too)
    assert next(r for r in report.rows if r.name == hack).max_reward > 0.0


def test_audit_command_takes_environment_arguments(capsys):
    assert cli.main(["audit-reward", "gui", "--tasks", "1", "--env-arg", "turn_rewards=true"]) == 0
    assert "| farm_saves | turn | 1 | 0 | 0 | ok |" in capsys.readouterr().out
    for bad, message in [("turn_rewards", "--env-arg turn_rewards: expected KEY=VALUE"),
                         ("level=2", "load_tasks takes no argument 'level'"),
                         ("turn_rewards=maybe", "turn_rewards must be true or false")]:
        assert cli.main(["audit-reward", "gui", "--tasks", "1", "--env-arg", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err


# -- metrics: per rollout --------------------------------------------------------------------------------
def episode(turn_rewards: list[tuple[float, dict]], outcome: float) -> Trajectory:
    return trajectory(outcome, turns=[Turn(1, 1, "stop", 0, reward=r, reward_parts=p) for r, p in turn_rewards])


def test_turn_reward_metrics_are_per_rollout():
    # rollout 1: three turns, -0.1 refused twice; rollout 2: one turn, +0.3 saved. Per turn the mean of
    # `refused` would be -0.2 / 4 turns = -0.05; per rollout it is -0.2 / 2 = -0.1
    trajs = [episode([(-0.1, {"refused": -0.1}), (0.0, {"refused": 0.0}), (-0.1, {"refused": -0.1})], 0.0),
             episode([(0.3, {"saved": 0.3})], 1.0)]
    assert turn_reward_metrics(trajs) == pytest.approx(
        {"turn_reward_mean": 0.05, "turn_reward/refused": -0.1, "turn_reward/saved": 0.15})
    m = rollout_metrics(trajs)
    assert m["reward_mean"] == 0.5 and m["turn_reward_mean"] == pytest.approx(0.05)  # the outcome's mean
    assert "turn_reward_mean" not in rollout_metrics([episode([(0.0, {})], 1.0)])  # none: no such figures


def test_an_environment_module_can_turn_its_rewards_on_through_env_args():
    spec = EnvSpec("calc", lambda task: CalculatorEnv(task), calculator_tasks).with_task_args({"turn_rewards": True})
    assert all(t["turn_rewards"] is True for t in spec.load_tasks(3))
    assert json.dumps(spec.load_tasks(1)[0])  # rows stay JSON (they go into traces and demos)
