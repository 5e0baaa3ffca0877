"""Integration of the training loop with a real vLLM server: weight sync after real steps, resume."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from helpers import LOGPROB_TOL, killed_after_step_2, served_name_of, server_config, server_logprobs
from safetensors.torch import load_file

from agent_rl import trainer
from agent_rl.learn.logprobs import token_logprobs
from agent_rl.learn.policy import load_causal_lm
from agent_rl.runs import traces

pytestmark = pytest.mark.integration
def test_two_steps_then_server_matches_trainer(tmp_path, vllm_server, renderer):
    run_dir = tmp_path / "run"
    final = asyncio.run(trainer.train(server_config(vllm_server, run_dir, steps=2)))
    assert final["train_tokens"] > 0 and final["time/sync_s"] < 5.0
    adapter = run_dir / "adapters" / "v2"
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_causal_lm(str(vllm_server.model_dir)), str(adapter)).eval()
    ids = renderer.render([]) + renderer.encode("A fixed sequence to score, the same on both sides.")
    with torch.no_grad():
        ours = token_logprobs(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)).logp_B_T[0, :-1]
        with model.disable_adapter():
            before = token_logprobs(model, torch.tensor([ids]),
                                    torch.ones(1, len(ids), dtype=torch.long)).logp_B_T[0, :-1]
    theirs = server_logprobs(vllm_server.url, served_name_of(vllm_server.url, adapter), ids)
    assert (ours - theirs).abs().max().item() < LOGPROB_TOL
    # and the update really moved the policy: the step-0 (base) log-probs differ clearly
    assert (before - theirs).abs().mean().item() > 1e-3
    assert (before - server_logprobs(vllm_server.url, "base", ids)).abs().max().item() < LOGPROB_TOL


def test_merged_sync_two_steps_then_the_plain_weights_are_the_trainers(tmp_path, dev_server, renderer):
    """model.sync merged: the server samples from plain weights = base + the trained LoRA, reloaded in
    place each step; the adapter the run leaves (adapter/) scores exactly what the server served at the
    end of training, and once the run is over the server serves its own base weights again."""
    from agent_rl.rollout.weight_sync.choose import start_weight_sync

    ids = renderer.render([]) + renderer.encode("A fixed sequence to score, the same on both sides.")
    served_last = []

    class Watched:  # the trainer's own sync; what the server serves is read just before it is restored
        def __init__(self, sync):
            self.sync = sync

        async def push(self, model, version):
            return await self.sync.push(model, version)

        async def restore(self, url):
            await self.sync.restore(url)

        async def finish(self):
            served_last.append(server_logprobs(dev_server.url, "base", ids))
            await self.sync.finish()

    async def watched_sync(*args):
        return Watched(await start_weight_sync(*args))

    run_dir = tmp_path / "run"
    cfg = server_config(dev_server, run_dir, steps=2, **{"model.sync": "merged"})
    final = asyncio.run(trainer.train(cfg, stages=trainer.Stages(sync=watched_sync)))
    assert final["train_tokens"] > 0 and final["time/sync_s"] < 10.0
    assert not (run_dir / "adapters").exists()  # no adapter versions were pushed
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_causal_lm(str(dev_server.model_dir)), str(run_dir / "adapter")).eval()
    with torch.no_grad():
        ours = token_logprobs(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)).logp_B_T[0, :-1]
        with model.disable_adapter():
            before = token_logprobs(model, torch.tensor([ids]),
                                    torch.ones(1, len(ids), dtype=torch.long)).logp_B_T[0, :-1]
    [theirs] = served_last
    assert (ours - theirs).abs().max().item() < LOGPROB_TOL
    assert (before - theirs).abs().mean().item() > 1e-3
    restored = server_logprobs(dev_server.url, "base", ids)
    assert (before - restored).abs().max().item() < LOGPROB_TOL  # the base model again


def test_resume_after_a_kill_ends_with_the_same_adapter(tmp_path, vllm_server, monkeypatch):
    """Stopped after step 2 of 4 and resumed == uninterrupted, given the same seed.

    Sources of nondeterminism, and why they do not bite here: sampling is seeded per request
    (run seed, step, task, rollout, turn); CPU fp32 training is deterministic; the only remaining
    one is vLLM's batch composition changing logits at ~1e-6, which flips a sampled token only on
    a near-tie. So we require identical rewards per step and adapters equal within 1e-5.
    """
    straight = tmp_path / "straight"
    asyncio.run(trainer.train(server_config(vllm_server, straight, steps=4)))

    killed = tmp_path / "killed"
    killed_after_step_2(monkeypatch, server_config(vllm_server, killed, steps=4))
    # traces the killed timeline may have left after its checkpoint: replaced (step 3) or dropped (step 9)
    for stray in (3, 9):
        traces.step_file(killed, stray).write_text(json.dumps({"step": stray, "task_id": "abandoned"}) + "\n")
    asyncio.run(trainer.train(server_config(vllm_server, killed, steps=4), resume=True))

    def rewards(run_dir):
        return [json.loads(x)["reward_mean"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]

    assert rewards(killed) == rewards(straight) and len(rewards(straight)) == 4

    def traced(run_dir):
        return {s: [(r["task_id"], r["group"], r["index"], r["reward"]) for r in records]
                for s, records in traces.read_traces(run_dir).items()}

    assert traced(killed) == traced(straight) and sorted(traced(straight)) == [1, 2, 3, 4]
    a = load_file(str(straight / "adapters" / "v4" / "adapter_model.safetensors"))
    b = load_file(str(killed / "adapters" / "v4" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


@pytest.mark.parametrize("staleness", [0, 1])
def test_resume_with_dynamic_sampling_skips_no_task_and_trains_none_twice(tmp_path, vllm_server, monkeypatch,
                                                                         staleness):
    """Dynamic sampling lets a step take more tasks than tasks_per_step, and with `max_staleness` 1 the next
    step's groups play while a step trains: the checkpoint holds the task position and the groups not yet
    trained, so a resumed run trains each task at most once. At k = 0 it restarts at the exact task (and
    per-request seeds) of the uninterrupted run; at k = 1 which task refills which slot depends on which
    group ends first, so only 'none twice' is the same whatever the timing."""
    sets = {"rollout.env": "half_flat_env", "algorithm.max_staleness": str(staleness),
            "algorithm.dynamic_sampling": "true", "algorithm.max_resample_batches": "1", "run.trace_groups": "2"}
    straight = tmp_path / "straight"
    asyncio.run(trainer.train(server_config(vllm_server, straight, steps=4, **sets)))

    killed = tmp_path / "killed"
    killed_after_step_2(monkeypatch, server_config(vllm_server, killed, steps=4, **sets))
    asyncio.run(trainer.train(server_config(vllm_server, killed, steps=4, **sets), resume=True))

    def positions(run_dir):
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [(x["step"], x["data_position"], x["resample_batches"]) for x in lines]

    def trained(run_dir):  # both groups of every step are traced (trace_groups 2 = tasks_per_step)
        return [r["task_id"] for records in traces.read_traces(run_dir).values() for r in records if r["index"] == 0]

    for run_dir in (straight, killed):
        assert len(trained(run_dir)) == 8 == len(set(trained(run_dir)))
    if staleness == 0:  # two tasks a step, one half of them flat: every step resamples one extra task
        assert positions(straight) == [(1, 3.0, 1.0), (2, 6.0, 1.0), (3, 9.0, 1.0), (4, 12.0, 1.0)]
        assert positions(killed) == positions(straight) and trained(killed) == trained(straight)
