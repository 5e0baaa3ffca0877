"""`algorithm.max_staleness: 0` is the synchronous loop, exactly; 1 samples what the old one-step overlap
(`algorithm.overlap_rollouts`) sampled. tests/stream_pinned.json was written by the training loop as it was
before the rollout stream (commit 6184c0f), on the scenarios below: every request's (seed, policy version),
each step's batch (ids, loss mask, sampler log-probs, advantages, the update's `stale` and seed), the logged
task positions and group counts, and the trained weights' fingerprint (as tests/test_update_pinned.py's).

The loop runs for real: `trainer.prepare` (the tiny random model, a rank-8 LoRA in float64, one thread),
the real `policy_update`, the toy environments; only the sampler is scripted, its reply a function of the
request's seed (as a seeded vLLM's is, whatever the order the requests come in), and the weight sync only
sets the version the sampler tags its completions with. On this machine every number is equal; the
tolerance on floats (relative 1e-9) only absorbs another machine's summation order.

To record new values after an intended change of behaviour: `.venv/bin/python tests/test_stream_pinned.py
--write`, and say why in the commit.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import VersionSync, here

from agent_rl import trainer
from agent_rl.config.file import load_config
from agent_rl.learn.update import policy_update
from agent_rl.rollout.sampler import Completion
from agent_rl.runs.runlog import RunLogger

PINNED = Path(__file__).resolve().parent / "stream_pinned.json"
# name -> (the overrides then, the overrides now): the old overlap is max_staleness 1 now
SCENARIOS = {
    "sync": ({"rollout.env": "toy"}, {}),
    "sync-dynamic": ({"rollout.env": "half_flat_env", "algorithm.dynamic_sampling": "true",
                      "algorithm.max_resample_batches": "2"}, {}),
    "sync-dynamic-1": ({"rollout.env": "half_flat_env", "algorithm.dynamic_sampling": "true",
                        "algorithm.max_resample_batches": "1"}, {}),
    "overlap": ({"rollout.env": "toy", "algorithm.overlap_rollouts": "true"}, {"algorithm.max_staleness": "1"}),
}
METRICS = ("step", "data_position", "resample_batches", "reward_mean", "zero_variance_group_share",
           "kept_trajectories", "dropped_trajectories")


class SeededSampler:
    """Replies "a" x (1 + seed mod 29) with log-prob -(1 + seed mod 7) / 8 a token; notes (seed, version)."""

    def __init__(self, renderer):
        self.renderer, self.policy_version, self.requests = renderer, 0, []

    async def sample(self, prompt_ids, params, messages=()):
        self.requests.append([params.seed, self.policy_version])
        ids = [*self.renderer.encode_reply("a" * (1 + params.seed % 29)), self.renderer.stop_token_ids[0]]
        await asyncio.sleep(0)
        return Completion(tuple(ids), tuple([-(1 + params.seed % 7) / 8] * len(ids)), "stop", self.policy_version)


def fingerprint(before, after):
    d = torch.cat([(after[n] - before[n]).flatten() for n in before]).double()
    gen = torch.Generator().manual_seed(1)
    r1, r2 = (torch.randn(d.shape, generator=gen, dtype=torch.float64) for _ in range(2))
    return {"moved": float((d != 0).sum()), "sum": float(d.sum()), "sum_sq": float((d * d).sum()),
            "proj1": float((d * r1).sum()), "proj2": float((d * r2).sum())}


def run_scenario(name: str, tiny: Path, out: Path) -> dict:
    sets = {"model.name": str(tiny), "model.lora_rank": "8", "model.lora_alpha": "16", "model.dtype": "float64",
            "optim.lr": "0.05", "rollout.tasks_per_step": "3", "rollout.group_size": "2", "rollout.max_turns": "1",
            "run.steps": "3", "run.seed": "5", "run.run_dir": str(out), "run.save_every": "100",
            "run.tensorboard": "false", "run.trace_groups": "0", **SCENARIOS[name][0]}
    sets = {k: v for k, v in sets.items() if k != "algorithm.overlap_rollouts"} | SCENARIOS[name][1]
    cfg = load_config(None, [f"{k}={v}" for k, v in sets.items()])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = trainer.prepare(cfg)
        sampler = SeededSampler(run.session.renderer)
        before = {n: p.detach().clone() for n, p in run.policy.model.named_parameters() if p.requires_grad}
        batches = []

        def update(policy, batch, algo, optim, temperature, seed, version):
            batches.append({"input_ids": batch.input_ids_B_T.tolist(), "loss_mask": batch.loss_mask_B_T.int().tolist(),
                            "sampler_logp": batch.sampler_logp_B_T.tolist(), "advantage": batch.advantage_B.tolist(),
                            "seed": seed, "version": version, "lags": sorted(set(lags(batch, version)))})
            return policy_update(policy, batch, algo, optim, temperature, seed, version)

        async def go():
            with RunLogger(out, cfg.run.steps, tensorboard=False, progress=False) as log:
                await trainer.loop(run, here(run, sampler), VersionSync(sampler), log, trainer.Stages(update=update))

        asyncio.run(go())
    finally:
        torch.set_num_threads(threads)
    after = {n: p.detach() for n, p in run.policy.model.named_parameters() if n in before}
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {"requests": sorted(sampler.requests), "batches": batches,
            "metrics": [{k: x[k] for k in METRICS if k in x} for x in lines], "weights": fingerprint(before, after)}


def lags(batch, version: int) -> list[int]:
    """The version lag of each sampled token of the batch (the update's trainer version minus the token's)."""
    return [version - v for v in batch.version_B_T[batch.loss_mask_B_T].tolist()]


def as_then(batches: list[dict]) -> list[dict]:
    """The batches without what the loop before the stream did not pass or passes no more (`stale`; the
    update's `version` and the tokens' lags): ids, masks, log-probs, advantages, seed."""
    return [{k: v for k, v in b.items() if k not in ("stale", "version", "lags")} for b in batches]


def close(a, b) -> bool:
    """Equal structures; floats within a relative 1e-9."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))
    return a == b


@pytest.fixture(scope="module")
def pinned():
    return json.loads(PINNED.read_text())


@pytest.mark.parametrize("name", ["sync", "sync-dynamic", "sync-dynamic-1"])
def test_staleness_0_is_the_synchronous_loop_exactly(name, tiny_dir, tmp_path, pinned):
    now = run_scenario(name, tiny_dir, tmp_path)
    want = pinned[name]
    assert now["requests"] == want["requests"]  # the same requests, each at the same policy version
    assert len(now["batches"]) == 3 and close(as_then(now["batches"]), as_then(want["batches"]))
    assert [b["lags"] for b in now["batches"]] == [[0]] * 3  # every token sampled by the trainer's version
    assert close(now["metrics"], want["metrics"])  # task positions, resampling rounds, group counts
    assert close(now["weights"], want["weights"])


def test_staleness_1_samples_what_the_old_overlap_sampled(tiny_dir, tmp_path, pinned):
    """The same requests (seed: the run seed, the step the group is for, task, rollout, turn) at the same policy
    versions. Which step trains which of those groups may differ where a later group ends first (here every
    group ends at once, so the batches are the old ones too). The update differs by the decoupled correction
    alone (the old one took the ratio against the sampler's log-probs, `stale`; now it is clipped from the
    trainer's own and each token weighted by min(pi_proximal / pi_behaviour, tis_cap): tests/test_decoupled.py
    shows, gradient by gradient, that this is the whole difference), so the trained weights are not the old
    ones: step 1 and 2 train on tokens one version old."""
    now = run_scenario("overlap", tiny_dir, tmp_path)
    want = pinned["overlap"]
    assert now["requests"] == want["requests"]
    assert {v for _, v in now["requests"]} == {0, 1}  # steps 0 and 1's groups at version 0, step 2's at 1
    assert [b["stale"] for b in want["batches"]] == [True, True, True]
    assert [b["lags"] for b in now["batches"]] == [[0], [1], [1]]
    assert close(as_then(now["batches"]), as_then(want["batches"])) and not close(now["weights"], want["weights"])


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    from agent_rl.learn.models import build_tiny_model, cache_dir, resolve_model

    tiny_model = build_tiny_model(resolve_model("smollm2-135m"), cache_dir() / "models" / "tiny-smollm2")
    result = {"_about": "see tests/test_stream_pinned.py"}
    for scenario in SCENARIOS:
        with tempfile.TemporaryDirectory() as scratch:
            result[scenario] = run_scenario(scenario, tiny_model, Path(scratch))
    PINNED.write_text(json.dumps(result, indent=0))
