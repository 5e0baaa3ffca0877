"""The rollout stream under torchrun: `trainer.train` at `algorithm.max_staleness: 2` as two gloo ranks (rank 0
owns the stream, rank 1 follows each step's batch) trains the same batches and ends with the same adapter as one
process, and no trained token is more than 2 versions old. The servers are a scripted sampler whose timing is
counted in versions (tests/stream_dist_worker.py), so the batches do not depend on how long an update takes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

WORKER = Path(__file__).resolve().parent / "stream_dist_worker.py"
# float64, two ranks summing each gradient in another order: 1.6e-10 relative apart at step 1 (GRPO's gradients
# cancel: + and - advantages), which six AdamW steps (each divides by the gradient's own size) carry to 4e-8 in the
# adapter (observed, lr 0.002); the updates move it by ~1e-2. A batch trained wrong on one rank moves it ~1e-3.
ADAPTER_TOL = 1e-6


def train_ranks(run_dir: Path, nproc: int) -> tuple[list[dict], list[dict], dict]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(WORKER),
           str(run_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trained = [json.loads(x) for x in (run_dir / "trained.jsonl").read_text().splitlines()]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return trained, metrics, load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def test_two_ranks_at_staleness_2_train_what_one_process_trains(tmp_path, tiny_dir):
    one = train_ranks(tmp_path / "one", 1)
    two = train_ranks(tmp_path / "two", 2)
    trained, metrics, adapter = two
    assert len(trained) == 6 and [x["step"] for x in metrics] == [1, 2, 3, 4, 5, 6]
    # 6 steps x 3 slots, 18 tasks, each trained once; the two slow ones as well (not starved)
    assert sorted(t for x in trained for t in x["tasks"]) == sorted({t for x in trained for t in x["tasks"]})
    assert sum(len(x["tasks"]) for x in trained) == 18 and sum(x["snails"] for x in trained) == 4
    lags = [step - v for step, x in enumerate(trained) for versions in x["versions"] for v in versions]
    assert max(lags) == 2 and min(lags) == 0  # the stream ran ahead, as far as k = 2 and no farther
    assert max(x["lag/max"] for x in metrics) == 2.0
    # the same batches (tasks, each token's version), the same losses and the same trained adapter
    assert two[0] == one[0]
    assert [x["loss"] for x in metrics] == pytest.approx([x["loss"] for x in one[1]], rel=1e-6)
    assert adapter.keys() == one[2].keys() and len(adapter) > 0
    assert max((adapter[k] - one[2][k]).abs().max().item() for k in adapter) < ADAPTER_TOL
    assert max(v.abs().max().item() for k, v in adapter.items() if "lora_B" in k) > 1e-3  # the updates moved it
