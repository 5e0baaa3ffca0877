"""Credit per turn in the training loop: on identical trajectories, a run with `credit: turn` logs the same
reward, success and turn-reward figures as one with `credit: trajectory` (they are per rollout, whatever the
credit), trains on an advantage per token, logs its own figures, and traces each turn's reward and advantage."""

from __future__ import annotations

import json

import torch
from helpers import here

from agent_rl import trainer
from agent_rl.config.file import load_config
from agent_rl.core.env import Env, StepResult
from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import Message, Reward, StopReason
from agent_rl.learn.policy import Policy
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.runs.runlog import RunLogger
from agent_rl.runs.traces import read_traces
from agent_rl.session import Session


class GoOrStop(Env):
    """Each "go" costs its turn 0.1 (part `waste`) and is answered "again"; "stop" ends the episode, solved
    (outcome 1) when it comes at the second turn."""

    def __init__(self, task):
        self.task = task

    async def initial_messages(self):
        return [Message("user", f"Task {self.task['id']}: say go once, then stop.")]

    async def step(self, reply, turn):
        if "stop" in reply.content:
            return StepResult(done=True, stop_reason=StopReason.NO_TOOL_CALL)
        return StepResult(messages=(Message("user", "again"),), reward=Reward(-0.1, {"waste": -0.1}))

    async def reward(self, messages):
        solved = float(sum(m.role == "assistant" for m in messages) == 2)
        return Reward(solved, {"solved": solved})


PLANS = [["stop"], ["go", "stop"], ["go", "go", "go"], ["go", "stop"]]  # outcomes 0, 1, 0, 1
SPEC = EnvSpec("go_or_stop", GoOrStop, lambda n, seed=0, split="train": [{"id": f"t{i}"} for i in range(n)])


async def run(tmp_path, scripted, smol_dir, renderer, credit: str):
    cfg = load_config(None, ["rollout.env=toy", "rollout.tasks_per_step=2", "rollout.group_size=4",
                             "rollout.max_turns=3", "run.steps=2", f"run.run_dir={tmp_path}", "run.save_every=100",
                             "run.tensorboard=false", "run.trace_groups=1", f"algorithm.credit={credit}"])
    started: dict[str, int] = {}

    def script(messages):  # rollout k of a task (in the order they start) follows PLANS[k % 4]
        said = [m.content for m in messages if m.role == "assistant"]
        if not said:
            task = messages[0].content
            started[task] = started.get(task, 0) + 1
            plan = (started[task] - 1) % len(PLANS)
        else:
            plan = int(said[0].rpartition("plan ")[2])
        return f"{PLANS[plan][len(said)]} plan {plan}"
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = Policy(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))
    run = trainer.Run(cfg, tmp_path, Session(cfg, smol_dir, renderer, SPEC), policy,
                      trainer.TaskStream(SPEC.load_tasks(8)), EpisodeLimits.from_config(cfg.rollout))
    batches = []

    def update(policy_, batch, algo, optim, temperature, seed, version):
        batches.append(batch)
        policy_.optimizer.step()  # no gradients: nothing moves (the loop steps the schedule after it)
        return {"loss": 0.0}

    class Sync:
        async def push(self, model, version):
            return 0.0

        async def finish(self):
            pass

    with RunLogger(tmp_path, cfg.run.steps, tensorboard=False, progress=False) as log:
        players = here(run, scripted(script, on_messages=True))
        await trainer.loop(run, players, Sync(), log, trainer.Stages(update=update))
    return [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()], batches


async def test_turn_credit_logs_the_same_rollout_figures_as_trajectory_credit(tmp_path, scripted, smol_dir, renderer):
    plain, plain_batches = await run(tmp_path / "trajectory", scripted, smol_dir, renderer, "trajectory")
    turn, turn_batches = await run(tmp_path / "turn", scripted, smol_dir, renderer, "turn")
    for key in ("reward_mean", "reward/solved", "turn_reward_mean", "turn_reward/waste", "turns_mean"):
        assert [m.get(key) for m in plain] == [m.get(key) for m in turn], key
    # step 1 by hand, each group of 4 playing PLANS: outcomes 0, 1, 0, 1; turn rewards 0, -0.1, -0.3, -0.1
    # per rollout (per turn it would be -0.5 / 8 turns)
    assert plain[0]["reward_mean"] == 0.5 and plain[0]["turn_reward_mean"] == -0.125
    assert plain[0]["turn_reward/waste"] == -0.125 and plain[0]["reward/solved"] == 0.5
    assert all(b.advantage_B_T is None for b in plain_batches)
    assert all(b.advantage_B_T is not None for b in turn_batches)
    assert "advantage_spread_mean" in turn[0] and "advantage_spread_mean" not in plain[0]
    [record, *_] = read_traces(tmp_path / "turn")[1]
    assert [t["reward"] for t in record["turns"]] == [0.0]  # the first rollout stops at once
    record = read_traces(tmp_path / "turn")[1][1]
    assert [t["reward"] for t in record["turns"]] == [-0.1, 0.0] and record["turns"][0]["reward_parts"] == \
        {"waste": -0.1}
    assert all(isinstance(t["advantage"], float) for t in record["turns"])
    [plain_record, *_] = read_traces(tmp_path / "trajectory")[1]
    assert [t["advantage"] for t in plain_record["turns"]] == [None]
