"""Bring-your-own-agent episodes (envs.calculator_agent: the real `openai` client through the real proxy) in the
rollout stream at `algorithm.max_staleness: 2`, with a weight push in the middle of an agent's episode: the real
loop, a scripted policy (the calculator's solver) and a scripted update; pushes move the version the sampler tags
its replies with while the agents' episodes go on."""

from __future__ import annotations

import pytest
from helpers import run_loop, scripted_run, until

openai = pytest.importorskip("openai", reason="agents are written with the openai client (pip install -e '.[agent]')")

from agent_rl.envs import calculator  # noqa: E402
from agent_rl.envs.agent_proxy import local_proxy  # noqa: E402
from agent_rl.rollout.engine import rollout_groups  # noqa: E402
from agent_rl.rollout.runner import EpisodeLimits  # noqa: E402
from agent_rl.rollout.scripted import ScriptedSampler  # noqa: E402

SLOW = (1, 4, 7)  # task positions whose second turn waits for a push after their first


class PushBetweenTurns(ScriptedSampler):
    """The calculator's solver as the policy (a calculator call, then the answer). For the SLOW tasks, the second
    turn is sampled only once a push has come after the first: a push lands in the middle of their episodes."""

    def __init__(self, renderer, tasks):
        by_question = {t["question"]: t for t in tasks}
        super().__init__(renderer, lambda messages: calculator.solve(by_question[messages[1].content], messages),
                         on_messages=True)
        self.slow = {tasks[i]["question"] for i in SLOW}
        self.first_turn_at: dict[str, int] = {}

    async def sample(self, prompt_ids, params, messages=()):
        question = messages[1].content
        if question in self.slow and any(m.role == "tool" for m in messages):
            first = self.first_turn_at[question]
            await until(lambda: self.policy_version > first, f"a push after the first turn of {question!r}")
        elif question in self.slow:
            self.first_turn_at[question] = self.policy_version
        return await super().sample(prompt_ids, params, messages)


async def test_an_agent_episode_goes_on_through_a_push_token_exact(tmp_path, smol_dir, renderer):
    tasks = calculator.load_tasks(12)
    run = scripted_run(tmp_path, smol_dir, renderer, tasks, "rollout.env=agent_rl.envs.calculator_agent",
                       "rollout.max_turns=4", "run.steps=4", "algorithm.max_staleness=2")
    seen, _ = await run_loop(run, PushBetweenTurns(renderer, tasks), train_s=0.02)
    trajs = [(step, t) for step, groups in enumerate(seen) for g in groups for t in g.trajectories]
    # 4 steps x 3 slots, one task each: every task trained once, the slow ones too
    assert sorted(g.task_id for groups in seen for g in groups) == sorted(str(t["id"]) for t in tasks)
    assert all(not t.infra_error and t.reward == 1.0 and len(t.turns) == 2 for _, t in trajs)
    split = [t for _, t in trajs if t.turns[0].policy_version < t.turns[1].policy_version]
    assert len(split) >= 2 * len(SLOW)  # each slow task's two episodes were pushed past between their turns
    lags = [step - v for step, t in trajs for v, m in zip(t.versions, t.loss_mask) if m]
    assert max(lags) <= 2 and max(lags) >= 1
    # the agents' trajectories are the native environment's, token for token, pushes or not
    native = await rollout_groups(tasks, calculator.make_env, ScriptedSampler(
        renderer, PushBetweenTurns(renderer, tasks).script, on_messages=True), renderer,
        EpisodeLimits(max_turns=4), 2)
    by_task = {g.task_id: g.trajectories[0] for g in native}
    for _, t in trajs:
        ref = by_task[t.task_id]
        assert (t.token_ids, t.loss_mask, t.logprobs, t.messages, t.turns[1].start) == \
            (ref.token_ids, ref.loss_mask, ref.logprobs, ref.messages, ref.turns[1].start)
    assert not local_proxy()._episodes  # every agent's episode left the proxy
