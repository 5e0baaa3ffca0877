"""Two ranks against one on the same global batch: the time of a policy update (forward, backward,
optimizer step) of SmolLM2-135M with a rank-16 LoRA, data-parallel under torchrun (gloo, FSDP2 over
the decoder layers, the adapter replicated), side by side in one run.

The batch: `--rows` sequences of `--tokens` tokens, half of them sampled (the recipe's shape: 32
rollouts of a few hundred tokens), advantages +1/-1. Each configuration runs `--reps` timed updates
after one warm-up, in its own torchrun job; the JSON line holds the medians and their ratio.

On this 2-core CPU two ranks cannot be faster than one: both share the same two cores (each rank is
given one thread) and pay for the all-gathers of the sharded layers and the adapter's all-reduce.
The figure shows the cost of the distribution machinery here, not the speed-up of two GPUs.

    python bench/ddp.py [--rows 32] [--tokens 256] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def batch_of(rows: int, tokens: int):
    import torch

    from agent_rl.learn.batching import collate

    class Row:
        def __init__(self, ids):
            n = len(ids)
            self.token_ids, self.loss_mask = tuple(ids), (0,) * (n // 2) + (1,) * (n - n // 2)
            self.logprobs = (0.0,) * (n // 2) + (-1.0,) * (n - n // 2)

    gen = torch.Generator().manual_seed(0)
    lengths = [tokens - (7 * b) % (tokens // 4) for b in range(rows)]  # uneven, as rollouts are
    return collate([Row(torch.randint(5, 40000, (n,), generator=gen).tolist()) for n in lengths],
                   [1.0 if b % 2 else -1.0 for b in range(rows)])


def worker(args) -> None:
    """One rank: build the policy, time `--reps` updates of the batch; rank 0 writes the figures."""
    import torch

    from agent_rl.config.file import load_config
    from agent_rl.learn.distributed import init_distributed
    from agent_rl.learn.models import resolve_model
    from agent_rl.learn.policy import build_policy
    from agent_rl.learn.update import policy_update

    cfg = load_config(None, ["model.device=cpu", "model.lora_rank=16", "optim.micro_batch_tokens=4096",
                             "algorithm.tis_cap=null"])
    dist = init_distributed("cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.world))
    torch.manual_seed(0)
    policy = build_policy(cfg.model, cfg.optim, resolve_model("smollm2-135m"), dist=dist)
    batch = batch_of(args.rows, args.tokens)
    times = []
    for rep in range(args.reps + 1):
        t0 = time.perf_counter()
        policy_update(policy, batch, cfg.algorithm, cfg.optim, 1.0, seed=rep)
        times.append(time.perf_counter() - t0)
    if dist.main:
        Path(args.out).write_text(json.dumps({"world": dist.world, "update_s": times[1:]}))


def run(nproc: int, args, tmp: Path) -> dict:
    out = tmp / f"ranks-{nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__,
           "--worker", "--out", str(out), "--rows", str(args.rows), "--tokens", str(args.tokens),
           "--reps", str(args.reps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"error: {nproc} rank(s) failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory(prefix="bench-ddp-") as tmp:
        one, two = (run(n, args, Path(tmp)) for n in (1, 2))
    m1, m2 = statistics.median(one["update_s"]), statistics.median(two["update_s"])
    print(json.dumps({"bench": "ddp", "model": "smollm2-135m", "lora_rank": 16, "rows": args.rows,
                      "tokens_per_row": args.tokens, "reps": args.reps, "one_rank_update_s": round(m1, 2),
                      "two_ranks_update_s": round(m2, 2), "two_over_one": round(m2 / m1, 3),
                      "one_rank_reps_s": [round(x, 2) for x in one["update_s"]],
                      "two_ranks_reps_s": [round(x, 2) for x in two["update_s"]], "cpu_cores": os.cpu_count()}))


if __name__ == "__main__":
    main()
