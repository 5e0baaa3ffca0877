"""A training run at `algorithm.max_staleness: 2` for tests/test_stream.py's resume test, in a process of its own
so that the test can SIGKILL it.

argv: RUN_DIR [--resume]. The real `trainer.prepare` (the tiny model's LoRA, checkpoints, resume) and the real
loop and stream; a scripted sampler (tests/helpers.py's `TimedSampler`: task "snails" 10x slower than the
rest) and a scripted update that only waits. Each step's trained task ids are appended to RUN_DIR/trained.jsonl
as the step trains them.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import TimedSampler, VersionSync, here, slow_snails

from agent_rl import trainer
from agent_rl.config.file import load_config
from agent_rl.learn.advantages import group_advantages
from agent_rl.learn.models import build_tiny_model, cache_dir, resolve_model
from agent_rl.runs.runlog import RunLogger

STEPS, TASKS_PER_STEP = 8, 3


def main(run_dir: Path, resume: bool) -> None:
    tiny = build_tiny_model(resolve_model("smollm2-135m"), cache_dir() / "models" / "tiny-smollm2")
    cfg = load_config(None, [f"model.name={tiny}", "model.lora_rank=4", "rollout.env=toy",
                             f"rollout.tasks_per_step={TASKS_PER_STEP}", "rollout.group_size=2",
                             "rollout.max_turns=1", "algorithm.max_staleness=2", f"run.steps={STEPS}",
                             f"run.run_dir={run_dir}", "run.save_every=1", "run.tensorboard=false",
                             "run.trace_groups=0"])
    run = trainer.prepare(cfg, resume=resume)
    run.tasks.tasks[4] = {**run.tasks.tasks[4], "topic": "snails"}  # one task 10x slower than the others
    sampler = TimedSampler(run.session.renderer, slow_snails)
    trained = run_dir / "trained.jsonl"
    steps = iter(range(run.start, STEPS))

    def advantages(groups, advantage_fn, credit):
        with trained.open("a") as f:  # flushed at close: a SIGKILL after this keeps the line
            f.write(json.dumps({"step": next(steps), "tasks": [g.task_id for g in groups]}) + "\n")
        return group_advantages(groups, advantage_fn, credit)

    def update(policy, batch, algo, optim, temperature, seed, version):
        time.sleep(0.25)  # a step's training time: long enough for the test to kill the run mid-way
        policy.optimizer.step()  # no gradients: nothing moves
        return {"loss": 0.0}

    async def go() -> None:
        with RunLogger(run_dir, STEPS, tensorboard=False, progress=False, start_step=run.start) as log:
            log.truncate_after(run.start)
            await trainer.loop(run, here(run, sampler), VersionSync(sampler), log,
                               trainer.Stages(advantages=advantages, update=update))

    asyncio.run(go())


if __name__ == "__main__":
    main(Path(sys.argv[1]), "--resume" in sys.argv[2:])
