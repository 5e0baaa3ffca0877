"""Run under torchrun by tests/test_distributed.py: one policy update on a fixed batch, as this rank of N.

argv: OUT (a .pt file rank 0 writes a list to: per case, the trained weights, gathered whole, and the statistics),
then the cases, separated by `--`, each config overrides key=value (one process group runs them all: each launch
costs the suite the ranks' start-up). The batch is helpers.make_batch's: every rank builds the same one.
Two keys are not config: `save=DIR` checkpoints the update there (gathered on rank 0, as the trainer
does); `resume=DIR` then builds a fresh policy, loads DIR's checkpoint and runs a second update,
whose weights the case's result holds as "resumed".
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import make_batch, tiny_config

from agent_rl.learn.distributed import full_optimizer_state, full_state_dict, init_distributed
from agent_rl.learn.models import cache_dir
from agent_rl.learn.policy import build_policy
from agent_rl.learn.reference import FrozenCopy
from agent_rl.learn.update import policy_update
from agent_rl.runs.checkpoint import load_checkpoint, save_checkpoint


def main() -> None:
    out, cases = Path(sys.argv[1]), [[]]
    for arg in sys.argv[2:]:
        cases[-1:] = [cases[-1], []] if arg == "--" else [[*cases[-1], arg]]
    dist = init_distributed("cpu")
    results = [one_case(dict(a.split("=", 1) for a in case), dist) for case in cases]
    if dist.main:
        torch.save(results, out)


def one_case(sets: dict[str, str], dist) -> dict:
    save, resume = sets.pop("save", None), sets.pop("resume", None)
    tiny = cache_dir() / "models" / "tiny-smollm2"
    cfg = tiny_config(tiny, **sets)
    torch.manual_seed(0)
    policy = build_policy(cfg.model, cfg.optim, tiny, dist=dist, with_reference=cfg.algorithm.kl_beta > 0)
    stats = policy_update(policy, make_batch(policy), cfg.algorithm, cfg.optim, 1.0, seed=3)
    weights = trained_weights(policy, dist)
    result = {"weights": weights, "stats": stats, "world": dist.world, "sharded": sharded(policy)}
    if save:
        optimizer_state = full_optimizer_state(policy.optimizer, dist)
        if dist.main:
            save_checkpoint(save, 1, policy.model, policy.optimizer, policy.scheduler, data_position=0,
                            weights=weights, optimizer_state=optimizer_state)
    if resume:
        torch_dist_barrier(dist)  # rank 0's checkpoint is complete before any rank reads it
        policy = build_policy(cfg.model, cfg.optim, tiny, dist=dist, with_reference=cfg.algorithm.kl_beta > 0)
        load_checkpoint(resume, policy.model, policy.optimizer, policy.scheduler, restore_rng=False)
        optimizer_state = full_optimizer_state(policy.optimizer, dist)
        result["loaded"] = (trained_weights(policy, dist), copy.deepcopy(optimizer_state))
        policy_update(policy, make_batch(policy), cfg.algorithm, cfg.optim, 1.0, seed=4)
        result["resumed"] = trained_weights(policy, dist)
    return result


def trained_weights(policy, dist) -> dict:
    """The trained weights, gathered whole on rank 0 (every rank takes part); {} on the others. Copied: the
    weights no rank shards are the live tensors."""
    trained = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    return {n: w.clone() for n, w in full_state_dict(policy.model, dist).items() if n in trained}


def sharded(policy) -> dict:
    """Which trained weights, and which weights of full fine-tuning's frozen KL reference, are sharded."""
    return {"policy": any(isinstance(p, DTensor) for p in policy.model.parameters() if p.requires_grad),
            "reference": isinstance(policy.reference, FrozenCopy) and any(
                isinstance(p, DTensor) for p in policy.reference.model.parameters())}


def torch_dist_barrier(dist) -> None:
    if dist.active:
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
