"""Run under torchrun by tests/test_stream_ranks.py: `trainer.train` at `algorithm.max_staleness: 2`, as this rank
of N, with the vLLM servers replaced by a scripted sampler (everything else is the real run: `prepare`, the policy
on every rank, rank 0's stream, the other ranks' `follow`, the update, the final adapter).

argv: RUN_DIR. Rank 0 writes RUN_DIR/trained.jsonl (each step's trained task ids and per-token versions) and,
as `train` does, RUN_DIR/adapter and RUN_DIR/metrics.jsonl.

The timing is counted in versions, not seconds, so that one rank and two ranks train the same batches: a request
of task "snails" ends once the servers have moved two versions past the one it started on; every other request
ends at once (after one turn of the event loop); and a push lets every request that can end, end first. So what
each step's batch may take (`Admission.choose`, at a point fixed by the pushes) is the same however long an
update takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path

from agent_rl import trainer
from agent_rl.config.file import load_config
from agent_rl.core.renderers.choose import load_renderer
from agent_rl.learn.advantages import group_advantages
from agent_rl.learn.models import cache_dir
from agent_rl.rollout.players import LocalPlayers, Served
from agent_rl.rollout.sampler import Completion
from agent_rl.rollout.supervisor import Supervisor

STEPS, TASKS_PER_STEP, SNAILS = 6, 3, (1, 7)  # task positions 1 and 7 are slow (2 versions)
SETTLE = 200  # event-loop turns a push lets pass first: every request that can end (each needs a few) ends


class VersionPaced:
    """Replies "a" x (1 + seed mod 29) + the turn end, tagged with the version served when it started, with the
    log-prob -10.8 (about the tiny random model's own: importance weights near 1, some capped)."""

    def __init__(self, renderer):
        self.renderer, self.policy_version, self.urls = renderer, 0, ["scripted://0"]
        self.pushed = asyncio.Event()  # set, then replaced, at each push

    async def sample(self, prompt_ids, params, messages=()):
        start = self.policy_version
        await asyncio.sleep(0)
        if "snails" in self.renderer.render_text(prompt_ids):
            while self.policy_version < start + 2:
                await self.pushed.wait()
        ids = [*self.renderer.encode_reply("a" * (1 + params.seed % 29)), self.renderer.stop_token_ids[0]]
        return Completion(tuple(ids), (-10.8,) * len(ids), "stop", start)


class Push:
    """A weight push: the servers sample with the new version (episodes in flight go on)."""

    def __init__(self, sampler: VersionPaced):
        self.sampler = sampler

    async def push(self, model, version):
        for _ in range(SETTLE):
            await asyncio.sleep(0)
        self.sampler.policy_version = version
        self.sampler.pushed.set()
        self.sampler.pushed = asyncio.Event()
        return 0.0

    async def restore(self, url):
        raise AssertionError(f"no server to restore ({url}): the sampler is a stand-in")

    async def finish(self):
        pass


def main(run_dir: Path) -> None:
    tiny = cache_dir() / "models" / "tiny-smollm2"  # the test builds it first
    cfg = load_config(None, [f"model.name={tiny}", "model.lora_rank=4", "model.dtype=float64", "optim.lr=0.002",
                             "rollout.env=toy", f"rollout.tasks_per_step={TASKS_PER_STEP}", "rollout.group_size=2",
                             "rollout.max_turns=1", "algorithm.max_staleness=2", f"run.steps={STEPS}",
                             f"run.run_dir={run_dir}", "run.save_every=100", "run.tensorboard=false",
                             "run.trace_groups=0"])
    sampler: list[VersionPaced] = []

    @contextlib.asynccontextmanager
    async def servers(session, log_path=None):  # `session.supervised_sampling` without a server to watch
        sampler.append(VersionPaced(load_renderer(session.model_dir)))
        async with Supervisor([], None, max_restarts=0, health_timeout_s=60.0, attach_wait_s=0.0) as supervisor:
            yield Served(sampler[0], LocalPlayers(session.env.make_env, sampler[0], session.renderer)), supervisor

    async def sync(model_cfg, rollout, max_staleness, run_dir, served, model, version):
        return Push(served)

    def advantages(groups, advantage_fn, credit):
        with (run_dir / "trained.jsonl").open("a") as f:
            f.write(json.dumps({"tasks": [g.task_id for g in groups], "versions": [
                sorted({v for v, m in zip(t.versions, t.loss_mask) if m}) for g in groups for t in g.trajectories],
                "snails": sum("snails" in t.messages[0].content for g in groups for t in g.trajectories)}) + "\n")
        return group_advantages(groups, advantage_fn, credit)

    trainer.supervised_sampling = servers  # the one stand-in: no vLLM server
    prepare = trainer.prepare

    def prepare_with_snails(cfg, resume=False, dist=trainer.Dist()):
        run = prepare(cfg, resume, dist)
        for i in SNAILS:
            run.tasks.tasks[i] = {**run.tasks.tasks[i], "topic": "snails"}
        return run

    trainer.prepare = prepare_with_snails
    asyncio.run(trainer.train(cfg, stages=trainer.Stages(advantages=advantages, sync=sync)))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
