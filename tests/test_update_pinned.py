"""`policy_update` pinned: for a matrix of algorithm settings, the statistics and the trained weights the
update gives are the ones recorded in tests/update_pinned.json. A change to any loss, ratio rule, off-policy
correction, aggregation, normaliser or statistic fails here.

History of the recorded numbers: first written by the update as it was before issue #24's refactor of
learn/update.py (which left them bit-identical); re-recorded for issue #25's decoupled correction, which
(a) removed the "stale" rule (the ratio against the sampler's log-probs) and its five cases, (b) made a mask
drop its tokens from the step's denominators too (the sequence-mask cases, renamed from "mismatch"), (c) added
the statistics `mis_dropped_frac` and, the pinned batch now carrying versions (half its rows one version
behind the trainer), the per-lag ones `lag0/...`, `lag1/...`. Every value the update computed before and
still computes was checked unchanged (within the tolerance below) in every case but those of (b).

Float64 on the tiny random model, one thread: the same machine reproduces every number exactly; the
tolerance (relative 1e-9) only absorbs another machine's summation order. A real change moves these
numbers by far more: AdamW's first step moves every weight with a gradient by about the learning rate.

The trained weights are pinned by a fingerprint of their change d = w_after - w_before (weights in
`named_parameters` order): how many entries moved (exact), sum(d), sum(d^2) and d projected on two fixed
random vectors. To record new values after an intended change of behaviour:
`.venv/bin/python tests/test_update_pinned.py --write`, and say why in the commit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import Row

from agent_rl.learn.batching import Batch, collate
from agent_rl.learn.logprobs import token_logprobs
from agent_rl.learn.policy import apply_lora, build_policy, load_causal_lm
from agent_rl.learn.update import policy_update

PINNED = Path(__file__).resolve().parent / "update_pinned.json"
# with the batch's sampler noise: some tokens capped, some rows dropped, some tokens dropped
SMALL_CAP, TIGHT_BOUNDS, TOKEN_BOUNDS = 1.2, "[0.95, 1.05]", "[0.75, 1.33]"

# name -> (config overrides, temperature)
CASES: dict[str, tuple[dict[str, object], float]] = {
    "ppo": ({}, 1.0),
    "ppo-tis1.2": ({"algorithm.tis_cap": SMALL_CAP}, 1.0),
    "ppo-tis-off": ({"algorithm.tis_cap": "null"}, 1.0),
    "ppo-tis0.9": ({"algorithm.tis_cap": 0.9}, 1.0),  # a cap below 1: every weight counts as capped
    "ppo-4mb-tis1.2": ({"algorithm.mini_batches": 4, "algorithm.tis_cap": SMALL_CAP}, 1.0),
    "ppo-2ep-2mb": ({"algorithm.epochs": 2, "algorithm.mini_batches": 2}, 1.0),
    "ppo-seqmean-2mb": ({"algorithm.aggregation": "sequence_mean", "algorithm.mini_batches": 2}, 1.0),
    "ppo-constant-2mb": ({"algorithm.aggregation": "constant", "algorithm.constant_norm_tokens": 16,
                          "algorithm.mini_batches": 2}, 1.0),
    "ppo-2mb-t0.7": ({"algorithm.mini_batches": 2}, 0.7),
    "gspo": ({"algorithm.loss": "gspo"}, 1.0),
    "gspo-2ep-tis-off": ({"algorithm.loss": "gspo", "algorithm.epochs": 2, "algorithm.tis_cap": "null"}, 1.0),
    "gspo-tokenmean-2mb": ({"algorithm.loss": "gspo", "algorithm.aggregation": "token_mean",
                            "algorithm.mini_batches": 2}, 1.0),
    "gspo-constant": ({"algorithm.loss": "gspo", "algorithm.aggregation": "constant"}, 1.0),
    "gspo-2ep-kl": ({"algorithm.loss": "gspo", "algorithm.epochs": 2, "algorithm.kl_beta": 0.1}, 1.0),
    "kl": ({"algorithm.kl_beta": 0.1}, 1.0),
    "kl-2mb": ({"algorithm.kl_beta": 0.1, "algorithm.mini_batches": 2}, 1.0),
    "sequence-mask": ({"algorithm.mismatch_mask": "sequence", "algorithm.mismatch_bounds": TIGHT_BOUNDS}, 1.0),
    "sequence-mask-2mb-tis1.2": ({"algorithm.mismatch_mask": "sequence", "algorithm.mismatch_bounds": TIGHT_BOUNDS,
                                  "algorithm.mini_batches": 2, "algorithm.tis_cap": SMALL_CAP}, 1.0),
    "token-mask": ({"algorithm.mismatch_mask": "token", "algorithm.mismatch_bounds": TOKEN_BOUNDS}, 1.0),
    "token-mask-seqmean-gspo": ({"algorithm.mismatch_mask": "token", "algorithm.mismatch_bounds": TOKEN_BOUNDS,
                                 "algorithm.loss": "gspo", "algorithm.aggregation": "sequence_mean"}, 1.0),
    "padded": ({"optim.share_prefixes": "false"}, 1.0),
    "padded-2mb-kl-mask": ({"optim.share_prefixes": "false", "algorithm.mini_batches": 2,
                            "algorithm.kl_beta": 0.1, "algorithm.mismatch_mask": "sequence",
                            "algorithm.mismatch_bounds": TIGHT_BOUNDS}, 1.0),
    "packed-small-micro": ({"optim.micro_batch_tokens": 24, "algorithm.mini_batches": 2,
                            "algorithm.kl_beta": 0.1}, 1.0),
    "full-finetune-kl-2mb": ({"model.full_finetune": "true", "optim.lr": 1e-3, "algorithm.kl_beta": 0.1,
                              "algorithm.mini_batches": 2}, 1.0),
    "saved-adapter-kl-2mb": ({"model.init_adapter": "SAVED", "algorithm.kl_beta": 0.1,
                              "algorithm.mini_batches": 2}, 1.0),
}
VERSION = 3  # the trainer's: rows 0-2 were sampled by it (lag 0), rows 3-5 by version 2 (lag 1)


def pinned_batch(model: torch.nn.Module) -> Batch:
    """6 rows in 3 pairs that share a 5-token prompt, 14-16 tokens long; advantages of both signs. The
    sampler's log-probs are the model's own plus noise (sd 0.25 nats a token), so that the importance
    weights and the masks all have something to act on; rows 3-5 are one version behind the trainer."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 1000, (6, 16), generator=gen)
    ids[1::2, :5] = ids[0::2, :5]
    noise = torch.randn((6, 16), generator=gen, dtype=torch.float64) * 0.25
    with torch.no_grad():
        logp = token_logprobs(model, ids, torch.ones_like(ids)).logp_B_T
    rows = []
    for b in range(6):
        n = 16 - b % 3
        mask = [0] * 5 + [1] * (n - 5)
        lp = [0.0] + [float(logp[b, t - 1] + noise[b, t]) if mask[t] else 0.0 for t in range(1, n)]
        version = [VERSION - (b >= 3) if m else -1 for m in mask]
        rows.append(Row(tuple(ids[b, :n].tolist()), tuple(mask), tuple(lp), tuple(version)))
    return collate(rows, [1.5, -1.0, 0.5, -0.5, 2.0, -2.0])


def saved_adapter(tiny_dir: Path, path: Path) -> Path:
    """A starting adapter that is not the base model (B != 0), as a cold-start SFT leaves one."""
    torch.manual_seed(1)
    model = apply_lora(load_causal_lm(str(tiny_dir), torch.float64), rank=8, alpha=16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.save_pretrained(path)
    return path


def fingerprint(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, float]:
    d = torch.cat([(after[n] - before[n]).flatten() for n in before]).double()
    gen = torch.Generator().manual_seed(1)
    r1, r2 = (torch.randn(d.shape, generator=gen, dtype=torch.float64) for _ in range(2))
    return {"moved": float((d != 0).sum()), "sum": float(d.sum()), "sum_sq": float((d * d).sum()),
            "proj1": float((d * r1).sum()), "proj2": float((d * r2).sum())}


def run_case(name: str, tiny_dir: Path, scratch: Path) -> dict[str, dict[str, float]]:
    from helpers import tiny_config

    sets, temperature = CASES[name]
    sets = {**sets, "model.dtype": "float64"}
    if sets.get("model.init_adapter") == "SAVED":
        sets["model.init_adapter"] = str(saved_adapter(tiny_dir, scratch / "saved-adapter"))
    cfg = tiny_config(tiny_dir, **sets)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        policy = build_policy(cfg.model, cfg.optim, tiny_dir, with_reference=cfg.algorithm.kl_beta > 0)
        batch = pinned_batch(policy.model)
        trained = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
        stats = policy_update(policy, batch, cfg.algorithm, cfg.optim, temperature, seed=3, version=VERSION)
        after = {n: p.detach() for n, p in policy.model.named_parameters() if n in trained}
        return {"stats": stats, "weights": fingerprint(trained, after)}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", list(CASES))
def test_the_update_gives_the_pinned_statistics_and_weights(name, tiny_dir, tmp_path):
    want = json.loads(PINNED.read_text())[name]
    got = run_case(name, tiny_dir, tmp_path)
    assert list(got["stats"]) == list(want["stats"])  # the same keys, in the same order
    for part in ("stats", "weights"):
        for key, value in want[part].items():
            assert got[part][key] == pytest.approx(value, rel=1e-9, abs=1e-12), f"{part}.{key}"
    assert got["weights"]["moved"] == want["weights"]["moved"]


def test_the_pinned_cases_exercise_what_they_pin():
    """The recorded numbers are not degenerate: the batch's noise makes each knob act."""
    pinned = json.loads(PINNED.read_text())
    stats = {name: case["stats"] for name, case in pinned.items()}
    assert 0.0 < stats["ppo-tis1.2"]["tis_capped_frac"] < 0.5
    assert stats["ppo-tis0.9"]["tis_capped_frac"] > 0.5  # below 1: most weights capped
    assert stats["ppo-4mb-tis1.2"]["clip_frac"] > 0.0 and stats["ppo"]["clip_frac"] == 0.0
    assert stats["kl-2mb"]["kl"] > 0.0 and stats["saved-adapter-kl-2mb"]["kl"] > 0.0
    assert stats["padded"]["computed_token_share"] > 1.0 > stats["ppo"]["computed_token_share"]
    for name in ("sequence-mask", "token-mask", "token-mask-seqmean-gspo"):
        assert 0.0 < stats[name]["mis_dropped_frac"] <= 0.5, name
    assert stats["ppo"]["lag0/token_share"] + stats["ppo"]["lag1/token_share"] == pytest.approx(1.0)
    assert stats["ppo"]["lag1/logprob_gap_mean"] > 0.0
    for a, b in [("ppo", "sequence-mask"), ("ppo", "token-mask"), ("ppo", "ppo-tis-off"), ("ppo", "ppo-tis1.2"),
                 ("sequence-mask", "token-mask")]:
        assert pinned[a]["weights"] != pinned[b]["weights"], (a, b)


def write(tiny_dir: Path) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        pinned = {name: run_case(name, tiny_dir, Path(scratch)) for name in CASES}
    PINNED.write_text(json.dumps(pinned, indent=1) + "\n")


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from agent_rl.learn.models import build_tiny_model, cache_dir, resolve_model

    write(build_tiny_model(resolve_model("smollm2-135m"), cache_dir() / "models" / "tiny-smollm2"))
