"""Data-parallel training: two gloo ranks (standing in for two GPUs) on the same batch end with the same
adapter (or, fully fine-tuned, the same weights) as one process, for token-mean and sequence-mean losses:
the loss normaliser is global. `agent-rl train --nproc 2` against real servers: tests/test_distributed_servers.py
(a module of its own, so that these tests, which start no server, run in the own lane)."""

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
