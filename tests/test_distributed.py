"""Data-parallel training: two gloo ranks (standing in for two GPUs) on the same batch end with the same
adapter (or, fully fine-tuned, the same weights) as one process, for token-mean and sequence-mean losses:
the loss normaliser is global."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agent_rl.learn.batching import collate, rank_micro_batches, rows_of
from agent_rl.learn.distributed import Dist

WORKER = Path(__file__).resolve().parent / "dist_update_worker.py"


def run_ranks(tmp_path: Path, nproc: int, cases: list[dict[str, str]], tiny_dir) -> list[dict]:
    """Each case's result, all of them run by one launch of `nproc` ranks (tests/dist_update_worker.py)."""
    out = tmp_path / f"out-{nproc}.pt"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    args = [x for k, case in enumerate(cases) for x in (["--"] if k else []) + [f"{a}={v}" for a, v in case.items()]]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(WORKER), str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = torch.load(out, weights_only=False)
    assert len(results) == len(cases)
    return results


SAME_WEIGHTS = {  # case -> its settings
    "token_mean": {"algorithm.aggregation": "token_mean"},
    "sequence_mean-2-steps-kl": {"algorithm.aggregation": "sequence_mean", "algorithm.mini_batches": "2",
                                 "algorithm.kl_beta": "0.1"},
    "full_finetune-2-steps-kl": {"model.full_finetune": "true", "algorithm.aggregation": "sequence_mean",
                                 "algorithm.mini_batches": "2", "algorithm.kl_beta": "0.1"},
}


def test_two_ranks_train_the_same_weights_as_one(tmp_path, tiny_dir):
    """Each case of SAME_WEIGHTS (one launch of each world size runs them all). In float64, so that summing in
    another order cannot hide a wrong normaliser: AdamW's first step divides each gradient by its own magnitude,
    which turns float32 noise on a near-zero gradient into a full-size difference (1e-4 observed in float32;
    2.5e-14 in float64, 5e-13 fully fine-tuned)."""
    cases = [{**sets, "model.dtype": "float64"} for sets in SAME_WEIGHTS.values()]
    for name, sets, one, two in zip(SAME_WEIGHTS, cases, run_ranks(tmp_path, 1, cases, tiny_dir),
                                    run_ranks(tmp_path, 2, cases, tiny_dir)):
        assert one["world"] == 1 and two["world"] == 2, name
        full = sets.get("model.full_finetune") == "true"  # its layers (and its KL reference's) sharded, not copied
        assert two["sharded"] == {"policy": full, "reference": full} and not any(one["sharded"].values()), name
        assert one["weights"].keys() == two["weights"].keys() and len(one["weights"]) > 0, name
        assert max_gap(one["weights"], two["weights"]) < 1e-10, name
        assert list(two["stats"]) == list(one["stats"]), name  # the same statistics, in the same order
        for key in ("loss", "grad_norm", "train_tokens", "clip_frac", "ratio_mean", "entropy", "optimizer_steps"):
            assert two["stats"][key] == pytest.approx(one["stats"][key], rel=1e-5, abs=1e-7), (name, key)


def max_gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and len(a) > 0
    return max((a[k] - b[k]).abs().max().item() for k in a)


def moments(optimizer_state: dict) -> dict:
    return {f"{i}.{k}": v for i, m in optimizer_state["state"].items() for k, v in m.items()}


def test_a_sharded_full_finetune_checkpoint_resumes_under_one_rank_or_two(tmp_path, tiny_dir):
    """Two ranks gather their shards into the checkpoint one process writes (weights and AdamW moments
    alike), and a second update after loading it, by two ranks or by one, ends where it should: in float64,
    to the same tight bound as above."""
    from agent_rl.runs.checkpoint import load_checkpoint

    sets = {"model.full_finetune": "true", "model.dtype": "float64", "algorithm.aggregation": "token_mean"}
    sharded_ck, single_ck = tmp_path / "ck-2", tmp_path / "ck-1"
    [two] = run_ranks(tmp_path, 2, [{**sets, "save": sharded_ck, "resume": sharded_ck}], tiny_dir)
    [one] = run_ranks(tmp_path, 1, [{**sets, "save": single_ck, "resume": sharded_ck}], tiny_dir)
    assert two["sharded"]["policy"] and max_gap(one["weights"], two["weights"]) < 1e-10
    saved = [torch.load(d / "checkpoints" / "step-000001" / "optimizer.pt", weights_only=True)
             for d in (sharded_ck, single_ck)]
    assert saved[0]["param_groups"] == saved[1]["param_groups"]
    assert max_gap(moments(saved[0]), moments(saved[1])) < 1e-10
    for run in (one, two):  # loaded exactly (two ranks: each its shards), then trained on alike
        weights, optimizer = run["loaded"]
        assert max_gap(weights, two["weights"]) == 0.0 and max_gap(moments(optimizer), moments(saved[0])) == 0.0
    assert max_gap(one["resumed"], two["resumed"]) < 1e-10
    assert max_gap(one["resumed"], one["weights"]) > 1e-4  # the second update did move the weights
    assert load_checkpoint(sharded_ck, restore_rng=False).step == 1


def test_rows_are_dealt_to_ranks_and_one_process_keeps_its_micro_batches():
    assert rows_of(7, Dist(0, 3)) == [0, 3, 6] and rows_of(7, Dist(2, 3)) == [2, 5] and rows_of(2, Dist(2, 3)) == []

    class Row:
        def __init__(self, n):
            self.token_ids, self.loss_mask, self.logprobs = tuple(range(5, 5 + n)), (0,) + (1,) * (n - 1), (0.0,) * n

    step = collate([Row(6), Row(4), Row(3)], [1.0, -1.0, 0.5])
    # one process: the step's own micro-batches, normalisers kept
    mbs = rank_micro_batches(step, Dist(), max_tokens=8)  # rows of 6, then 4 + 3 padded to 4: 8 tokens
    assert [mb.input_ids_B_T.shape[0] for mb in mbs] == [1, 2]
    assert all((mb.step_num_tokens, mb.step_num_sequences) == (10, 3) for mb in mbs)
    # the real two-rank case (fillers when a rank holds fewer micro-batches) runs in the test above


def agent_rl_train(run_dir: Path, urls: list[str], model_dir, steps: int, *extra: str,
                   sets: dict | None = None) -> subprocess.Popen:
    sets = {"model.name": model_dir, "model.lora_rank": 8, "model.lora_alpha": 16, "model.sync": "adapter",
            "sampler.server_urls": f"[{','.join(urls)}]", "sampler.max_model_len": 2048, "rollout.env": "toy",
            "rollout.tasks_per_step": 2, "rollout.group_size": 4, "rollout.max_turns": 1,
            "rollout.max_tokens_per_turn": 32, "rollout.max_total_tokens": 128, "optim.lr": "3e-3",
            "run.steps": steps, "run.run_dir": run_dir, "run.seed": 7, "run.tensorboard": "false", **(sets or {})}
    cmd = [str(Path(sys.executable).with_name("agent-rl")), "train", "--nproc", "2", "--no-plot",
           *[f"--set={k}={v}" for k, v in sets.items()], *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen, timeout_s: float = 900) -> str:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err[-3000:]
    return out


def test_a_run_shuts_its_process_group_down_and_one_process_has_none_to_shut():
    """`close_distributed` at a run's normal end: the group is destroyed (left to interpreter exit, gloo's threads
    can abort the rank). A one-rank group stands in for the ranks; a single process (`Dist()`) leaves it alone."""
    import torch.distributed as torch_dist

    from agent_rl.learn.distributed import close_distributed

    torch_dist.init_process_group("gloo", store=torch_dist.HashStore(), rank=0, world_size=1)
    try:
        close_distributed(Dist())  # one process: not a torchrun job, nothing of its own to shut
        assert torch_dist.is_initialized()
        close_distributed(Dist(rank=0, world=2))
        assert not torch_dist.is_initialized()
        close_distributed(Dist(rank=0, world=2))  # already shut: nothing to do
    finally:
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()


@pytest.mark.integration
@pytest.mark.timeout(1800)  # three 2-rank runs, and maybe the start of the second session server
def test_two_ranks_two_servers_train_resume_and_match(tmp_path, vllm_server, dev_server, tiny_dir, renderer):
    """`agent-rl train --nproc 2` against two vLLM servers: every step's adapter reaches both and serves the
    trainer's log-probs; killed after its checkpoint of step 2 and resumed, it ends with the same adapter as
    the run that was never stopped."""
    import json
    import signal
    import time

    from helpers import LOGPROB_TOL, served_name_of, server_logprobs
    from peft import PeftModel
    from safetensors.torch import load_file

    from agent_rl.learn.logprobs import token_logprobs
    from agent_rl.learn.policy import load_causal_lm

    urls = [vllm_server.url, dev_server.url]
    straight = tmp_path / "straight"
    finish(agent_rl_train(straight, urls, tiny_dir, 3))
    final = json.loads((straight / "metrics.jsonl").read_text().splitlines()[-1])  # the last step's, as printed
    assert final["train_tokens"] > 0
    adapter = straight / "adapters" / "v3"
    model = PeftModel.from_pretrained(load_causal_lm(str(tiny_dir)), str(adapter)).eval()
    ids = renderer.render([]) + renderer.encode("A fixed sequence to score, the same everywhere.")
    with torch.no_grad():
        ours = token_logprobs(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)).logp_B_T[0, :-1]
    for url in urls:  # both servers hold the last version
        theirs = server_logprobs(url, served_name_of(url, adapter), ids)
        assert (ours - theirs).abs().max().item() < LOGPROB_TOL

    killed = tmp_path / "killed"
    proc = agent_rl_train(killed, urls, tiny_dir, 3)
    latest, deadline = killed / "checkpoints" / "latest", time.monotonic() + 900
    while not (latest.is_file() and latest.read_text().strip() >= "step-000002"):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its step-2 checkpoint"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks, mid-run
    proc.wait(timeout=60)
    finish(agent_rl_train(killed, urls, tiny_dir, 3, "--resume"))

    a = load_file(str(straight / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(killed / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    rewards = [[json.loads(x)["reward_mean"] for x in (d / "metrics.jsonl").read_text().splitlines()]
               for d in (straight, killed)]
    assert rewards[0] == rewards[1] and len(rewards[0]) == 3


@pytest.mark.integration
@pytest.mark.timeout(1200)  # two 2-rank runs (3 steps in all), and maybe the start of the dev-mode server
def test_two_ranks_full_finetune_push_checkpoint_and_resume(tmp_path, dev_server, tiny_dir, renderer):
    """`agent-rl train --nproc 2` fully fine-tuning against a dev-mode server: each push gathers the sharded
    weights on rank 0 and the server then serves exactly the trainer's log-probs (those of the step-2
    checkpoint, gathered apart); a second run resumed from the step-1 checkpoint ends equal to the first."""
    import json
    import shutil

    from helpers import LOGPROB_TOL, server_logprobs

    from agent_rl.learn.logprobs import token_logprobs
    from agent_rl.learn.policy import enable_full_finetune, load_causal_lm
    from agent_rl.runs.checkpoint import load_checkpoint

    full = {"model.full_finetune": "true", "model.sync": "auto", "optim.lr": "1e-4", "run.save_every": 1}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    finish(agent_rl_train(straight, [dev_server.url], tiny_dir, 2, sets=full))
    final = json.loads((straight / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["train_tokens"] > 0
    model = enable_full_finetune(load_causal_lm(str(tiny_dir)))
    assert load_checkpoint(straight, model, restore_rng=False).step == 2
    ids = renderer.render([]) + renderer.encode("A fixed sequence to score, the same everywhere.")
    with torch.no_grad():
        ours = token_logprobs(model.eval(), torch.tensor([ids]),
                              torch.ones(1, len(ids), dtype=torch.long)).logp_B_T[0, :-1]
    start = token_logprobs(load_causal_lm(str(tiny_dir)), torch.tensor([ids]),
                           torch.ones(1, len(ids), dtype=torch.long))
    assert (ours - start.logp_B_T[0, :-1]).abs().max().item() > 10 * LOGPROB_TOL  # two steps moved the policy
    assert (ours - server_logprobs(dev_server.url, "base", ids)).abs().max().item() < LOGPROB_TOL

    # as if killed after step 1: the second run finds only the step-1 checkpoint
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step-000001", resumed / "checkpoints" / "step-000001")
    (resumed / "checkpoints" / "latest").write_text("step-000001\n")
    finish(agent_rl_train(resumed, [dev_server.url], tiny_dir, 2, "--resume", sets=full))
    a, b = (load_checkpoint(d, restore_rng=False).path / "weights.safetensors" for d in (straight, resumed))
    assert b.parent.name == "step-000002"
    from safetensors.torch import load_file

    assert max_gap(load_file(str(a)), load_file(str(b))) < 1e-5
    rewards = [[json.loads(x)["reward_mean"] for x in (d / "metrics.jsonl").read_text().splitlines()]
               for d in (straight, resumed)]
    assert rewards[1] == rewards[0][1:] and len(rewards[0]) == 2
