"""A training run for tests/test_preemption.py, in a process of its own so that the test can signal it.

argv: RUN_DIR [--resume] [--slow]. The real `trainer.prepare` (the tiny model's LoRA, checkpoints, resume),
the real loop and stream at staleness 0 (each step's batch fixed by its seeds) under `preemption.watch`, as
`trainer.train` runs it; a scripted sampler (tests/test_stream.py's `TimedSampler`; each request 0.01 s, 1 s
with --slow) and a scripted update that moves every LoRA weight by a rule of the step's batch and seed (so the
final weights say which batches were trained, in which order). Each step's trained task ids are appended to
RUN_DIR/trained.jsonl; the final LoRA weights go to RUN_DIR/final.pt. A stop signal ends it as `agent-rl
train` does: the `Preempted` line on stderr, its exit status.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from test_stream import TimedSampler, VersionSync

from agent_rl import trainer
from agent_rl.core.config_file import load_config
from agent_rl.learn.advantages import group_advantages
from agent_rl.learn.models import build_tiny_model, cache_dir, resolve_model
from agent_rl.preemption import Preempted, watch
from agent_rl.runs.runlog import RunLogger

STEPS = 4


def main(run_dir: Path, resume: bool, slow: bool = False) -> None:
    tiny = build_tiny_model(resolve_model("smollm2-135m"), cache_dir() / "models" / "tiny-smollm2")
    cfg = load_config(None, [f"model.name={tiny}", "model.lora_rank=4", "rollout.env=toy",
                             "rollout.tasks_per_step=3", "rollout.group_size=2", "rollout.max_turns=1",
                             "algorithm.max_staleness=0", f"run.steps={STEPS}", f"run.run_dir={run_dir}",
                             "run.save_every=3", "run.tensorboard=false", "run.trace_groups=0"])
    run = trainer.prepare(cfg, resume=resume)
    sampler = TimedSampler(run.session.renderer, lambda prompt: 1.0 if slow else 0.01)
    trained = run_dir / "trained.jsonl"
    steps = iter(range(run.start, STEPS))

    def advantages(groups, advantage_fn, truncated_reward, credit):
        with trained.open("a") as f:
            f.write(json.dumps({"step": next(steps), "tasks": [g.task_id for g in groups]}) + "\n")
        return group_advantages(groups, advantage_fn, truncated_reward, credit)

    def update(policy, batch, algo, optim, temperature, seed, version):
        time.sleep(0.5)  # a step's training time: the test signals the run in it
        shift = float(batch.input_ids_B_T.float().mean()) * 1e-3 + (seed % 7) * 1e-4
        with torch.no_grad():
            for p in policy.model.parameters():
                if p.requires_grad:
                    p.mul_(0.5).add_(shift)  # not commutative: the order of the batches shows
        policy.optimizer.step()  # no gradients: nothing more moves (the loop steps the schedule after it)
        return {"loss": 0.0}

    async def go() -> None:
        with RunLogger(run_dir, STEPS, tensorboard=False, progress=False, start_step=run.start) as log:
            log.truncate_after(run.start)
            with watch(run.stop):
                await trainer.loop(run, sampler, VersionSync(sampler), log,
                                   trainer.Stages(advantages=advantages, update=update))

    try:
        asyncio.run(go())
    except Preempted as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.code)
    weights = {n: p.detach().clone() for n, p in run.policy.model.named_parameters() if p.requires_grad}
    torch.save(weights, run_dir / "final.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), "--resume" in sys.argv[2:], "--slow" in sys.argv[2:])
