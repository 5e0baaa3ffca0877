"""A training run for tests/test_preemption.py, in a process of its own so that the test can signal it.

argv: RUN_DIR [--resume] [--slow] [--hold] [--stand-in]. The real `trainer.prepare` (the tiny model's LoRA,
checkpoints, resume), the real loop and stream at staleness 0 (each step's batch fixed by its seeds) under
`preemption.watch`, as `trainer.train` runs it; a scripted sampler (tests/helpers.py's `TimedSampler`; each
request 0.01 s; with --slow, step 3's (version 2) wait 600 s, so that a signal after step 2 is logged finds step 3
sampling however late it comes) and a scripted update that moves every LoRA weight by a rule of the step's batch and
seed (so the final weights say which batches were trained, in which order); with --hold, step 2's update waits
(up to 120 s) for a stop signal or the stand-in server's end, so that the test's signal or kill comes during it
however late. Each step's trained task ids are appended to RUN_DIR/trained.jsonl; the final LoRA weights go to
RUN_DIR/final.pt. With --stand-in, a stand-in server: a process (its pid in RUN_DIR/server.pid) that a push needs
alive, as a vLLM server's /pause must answer. Errors end it as `agent-rl train` does (`commands.errors_as_lines`):
one line on stderr, the exit status.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from helpers import TimedSampler, VersionSync, here

from agent_rl import trainer
from agent_rl.commands import CLIError, errors_as_lines
from agent_rl.config.file import load_config
from agent_rl.learn.advantages import group_advantages
from agent_rl.learn.models import build_tiny_model, cache_dir, resolve_model
from agent_rl.rollout.weight_sync.base import WeightSyncError
from agent_rl.runs.runlog import RunLogger
from agent_rl.stopping import watch

STEPS = 4


class StandInSync(VersionSync):
    """A push fails, as against a vLLM server that was killed, once the stand-in server's process has ended."""

    def __init__(self, sampler, server: subprocess.Popen):
        super().__init__(sampler)
        self.server = server

    async def push(self, model, version):
        if self.server.poll() is not None:
            raise WeightSyncError("vLLM server http://127.0.0.1:1 did not answer POST /pause?mode=wait "
                                  "(connection refused)")
        return await super().push(model, version)


def main(run_dir: Path, resume: bool, slow: bool = False, stand_in: bool = False, hold: bool = False) -> None:
    tiny = build_tiny_model(resolve_model("smollm2-135m"), cache_dir() / "models" / "tiny-smollm2")
    cfg = load_config(None, [f"model.name={tiny}", "model.lora_rank=4", "rollout.env=toy",
                             "rollout.tasks_per_step=3", "rollout.group_size=2", "rollout.max_turns=1",
                             "algorithm.max_staleness=0", f"run.steps={STEPS}", f"run.run_dir={run_dir}",
                             "run.save_every=3", "run.tensorboard=false", "run.trace_groups=0"])
    run = trainer.prepare(cfg, resume=resume)
    sampler = TimedSampler(run.session.renderer, lambda prompt: 600.0 if slow and sampler.policy_version == 2 else 0.01)
    trained = run_dir / "trained.jsonl"
    steps = iter(range(run.start, STEPS))
    at = {"step": -1}  # the step being trained (its advantages come first)
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) if stand_in else None

    def held() -> None:
        """Step 2's update, with --hold: until the test's signal or kill (module doc)."""
        deadline = time.monotonic() + 120
        while not (run.stop.requested or (server is not None and server.poll() is not None)):
            assert time.monotonic() < deadline, "no signal came during step 2's update"
            time.sleep(0.01)

    def advantages(groups, advantage_fn, credit):
        with trained.open("a") as f:
            at["step"] = next(steps)
            f.write(json.dumps({"step": at["step"], "tasks": [g.task_id for g in groups]}) + "\n")
        return group_advantages(groups, advantage_fn, credit)

    def update(policy, batch, algo, optim, temperature, seed, version):
        if at["step"] == 1 and hold:
            held()
        shift = float(batch.input_ids_B_T.float().mean()) * 1e-3 + (seed % 7) * 1e-4
        with torch.no_grad():
            for p in policy.model.parameters():
                if p.requires_grad:
                    p.mul_(0.5).add_(shift)  # not commutative: the order of the batches shows
        policy.optimizer.step()  # no gradients: nothing more moves (the loop steps the schedule after it)
        return {"loss": 0.0}

    async def go(sync: VersionSync) -> None:
        with RunLogger(run_dir, STEPS, tensorboard=False, progress=False, start_step=run.start) as log:
            log.truncate_after(run.start)
            with watch(run.stop):
                stages = trainer.Stages(advantages=advantages, update=update)
                await trainer.loop(run, here(run, sampler), sync, log, stages)

    try:
        (run_dir / "server.pid").write_text(str(server.pid if server else ""))
        with errors_as_lines():
            asyncio.run(go(StandInSync(sampler, server) if server else VersionSync(sampler)))
    except CLIError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.code)
    finally:
        if server is not None:  # as `session.sampling` stops the servers a run started
            server.kill()
            server.wait(timeout=30)
    weights = {n: p.detach().clone() for n, p in run.policy.model.named_parameters() if p.requires_grad}
    torch.save(weights, run_dir / "final.pt")


if __name__ == "__main__":
    flags = sys.argv[2:]
    main(Path(sys.argv[1]), "--resume" in flags, "--slow" in flags, "--stand-in" in flags, "--hold" in flags)
