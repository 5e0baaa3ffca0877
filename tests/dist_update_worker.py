"""Run under torchrun by tests/test_distributed.py: one policy update on a fixed batch, as this rank of N.

argv: OUT (a .pt file rank 0 writes the trained weights, gathered whole, and the statistics to), then
config overrides key=value. The batch is test_update.make_batch's: every rank builds the same one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_update import config, make_batch  # noqa: E402

from agent_rl.learn.distributed import full_state_dict, init_distributed  # noqa: E402
from agent_rl.learn.models import cache_dir  # noqa: E402
from agent_rl.learn.policy import build_policy  # noqa: E402
from agent_rl.learn.reference import FrozenCopy  # noqa: E402
from agent_rl.learn.update import policy_update  # noqa: E402


def main() -> None:
    out, sets = Path(sys.argv[1]), dict(a.split("=", 1) for a in sys.argv[2:])
    tiny = cache_dir() / "models" / "tiny-smollm2"
    cfg = config(tiny, **sets)
    dist = init_distributed("cpu")
    torch.manual_seed(0)
    policy = build_policy(cfg.model, cfg.optim, tiny, dist=dist, with_reference=cfg.algorithm.kl_beta > 0)
    batch = make_batch(policy)
    stats = policy_update(policy, batch, cfg.algorithm, cfg.optim, 1.0, seed=3)
    trained = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    weights = full_state_dict(policy.model, dist)  # every rank takes part; {} but on rank 0
    if dist.main:
        weights = {n: w for n, w in weights.items() if n in trained}
        # which trained weights, and which weights of full fine-tuning's frozen KL reference, are sharded
        sharded = {"policy": any(isinstance(p, DTensor) for p in policy.model.parameters() if p.requires_grad),
                   "reference": isinstance(policy.reference, FrozenCopy) and any(
                       isinstance(p, DTensor) for p in policy.reference.model.parameters())}
        torch.save({"weights": weights, "stats": stats, "world": dist.world, "sharded": sharded}, out)


if __name__ == "__main__":
    main()
