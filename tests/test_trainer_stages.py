"""The training loop with its seams filled by plain test objects: a sampler that notes each request's seed
(`rollout.sampler.Sampler`), a stream stage and an update stage written here (`trainer.StreamStage`,
`trainer.UpdateStage`), a weight sync that only notes its pushes (`rollout.weight_sync.WeightSync`).
No server and no language model: what the loop hands each stage is checked against values worked out by
hand (task positions, the update's seeds, one push per step with the version = steps taken)."""

from __future__ import annotations

import json

import torch
from helpers import here

from agent_rl import trainer
from agent_rl.config.file import load_config
from agent_rl.core.seeds import request_seed
from agent_rl.learn.policy import Policy
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.runs.runlog import RunLogger
from agent_rl.session import Session, env_of


class NotingSampler:
    """The scripted sampler, each request's sampling seed noted."""

    def __init__(self, inner):
        self.inner, self.seeds = inner, []

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    async def sample(self, prompt_ids, params, messages=()):
        self.seeds.append(params.seed)
        return await self.inner.sample(prompt_ids, params, messages)


class NotingSync:
    """A weight sync that pushes nothing anywhere: it notes (model, version) and whether it was finished."""

    def __init__(self):
        self.pushes, self.finished = [], False

    async def push(self, model, version: int) -> float:
        self.pushes.append((model, version))
        return 0.0

    async def finish(self) -> None:
        self.finished = True


async def test_the_loop_hands_each_stage_what_its_protocol_says(tmp_path, scripted, smol_dir, renderer):
    cfg = load_config(None, ["rollout.env=toy", "rollout.tasks_per_step=2", "rollout.group_size=2",
                             "rollout.max_turns=1", "run.steps=3", "run.seed=7", f"run.run_dir={tmp_path}",
                             "run.save_every=100", "run.tensorboard=false", "run.trace_groups=0"])
    lengths = iter(range(1, 100))  # every reply one character longer: the toy env's rewards all differ
    sampler = NotingSampler(scripted(lambda text: "a" * next(lengths)))
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = Policy(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))
    tasks = [{"id": f"t{i}", "topic": "cats"} for i in range(8)]
    run = trainer.Run(cfg, tmp_path, Session(cfg, smol_dir, renderer, env_of(cfg)), policy, trainer.TaskStream(tasks),
                      EpisodeLimits.from_config(cfg.rollout))
    opened, asked, updates = [], [], []

    def stream(run_, players_):
        opened.append((run_ is run, players_ is players))
        inner = trainer.open_stream(run_, players_)
        batch = inner.batch

        async def noted(step):
            asked.append((step, run_.tasks.position))  # the tasks handed out when the step asks
            return await batch(step)

        inner.batch = noted
        return inner

    def update(policy_, batch, algo, optim, temperature, seed, version):
        updates.append((policy_ is policy, batch.input_ids_B_T.shape[0], algo is cfg.algorithm, optim is cfg.optim,
                        temperature, seed, version))
        policy_.optimizer.step()  # no gradients: nothing moves (the loop steps the schedule after it)
        return {"loss": 0.25}

    sync = NotingSync()
    with RunLogger(tmp_path, cfg.run.steps, tensorboard=False, progress=False) as log:
        players = here(run, sampler)
        final = await trainer.loop(run, players, sync, log, trainer.Stages(stream=stream, update=update))

    assert opened == [(True, True)]  # one stream for the run
    assert asked == [(0, 2), (1, 4), (2, 6)]  # step s asks once the push before it opened its 2 tasks
    # the update's seed: 7 x 1,000,003 + step; its version: the steps taken; 2 tasks x 2 rollouts, every group
    # with signal: 4 rows
    assert updates == [(True, 4, True, True, 1.0, 7_000_021, 0), (True, 4, True, True, 1.0, 7_000_022, 1),
                       (True, 4, True, True, 1.0, 7_000_023, 2)]
    assert sync.pushes == [(model, 1), (model, 2), (model, 3)] and not sync.finished  # `train` finishes it
    # step 0's requests: the round seed (7 x 1,000,003 + 0) x 101 + 0 = 707,002,121, per task and rollout
    assert set(sampler.seeds[:4]) == {request_seed(707_002_121, f"t{i}", r, 0) for i in (0, 1) for r in (0, 1)}
    assert len(set(sampler.seeds)) == 12
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3] and {x["loss"] for x in lines} == {0.25}
    assert [x["data_position"] for x in lines] == [2.0, 4.0, 6.0] and final["loss"] == 0.25
