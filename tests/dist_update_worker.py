"""Run under torchrun by tests/test_distributed.py: one policy update on a fixed batch, as this rank of N.

argv: OUT (a .pt file rank 0 writes the trained adapter weights and the statistics to), then config
overrides key=value. The batch is test_update.make_batch's: every rank builds the same one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_update import config, make_batch  # noqa: E402

from agent_rl.learn.distributed import init_distributed  # noqa: E402
from agent_rl.learn.models import cache_dir  # noqa: E402
from agent_rl.learn.policy import build_policy, trainable_parameters  # noqa: E402
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
    if dist.main:
        weights = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p in set(trainable_parameters(policy.model))}
        torch.save({"weights": weights, "stats": stats, "world": dist.world}, out)


if __name__ == "__main__":
    main()
