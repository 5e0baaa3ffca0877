"""The first thing to run on a CUDA machine: does the GPU path of agent-rl work here?

Trains a 2-step GRPO run of a rank-16 LoRA on SmolLM2-135M (the toy environment's dense reward) with
the trainer on CUDA in bfloat16 and a vLLM server started on the same GPU (bfloat16, a 0.3 share of
its memory), then checks that the server's log-probs of a fixed token sequence under the trained
adapter equal the trainer's within the bf16 bound measured on the CPU (tests/test_bf16_vllm.py:
max 0.05, mean 0.005 nats). Prints the figures, `PASS` or `FAIL: <why>`, and one JSON line.

    make gpu-check            (BUILD=gpu installs the CUDA build of vLLM)
    python bench/gpu_check.py [--allow-cpu]   # --allow-cpu: the same path on the CPU, in float32
If it fails, the JSON line and the server log named in it are what a bug report needs (where it has and has not
run: docs/performance.md#what-has-run-on-a-gpu).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

MAX_GAP, MEAN_GAP = 0.05, 0.005  # bf16 bounds (tests/test_bf16_vllm.py); fp32 agrees to ~1e-6


def served_logprobs(url: str, adapter: Path, ids: list[int]) -> torch.Tensor:
    """The server's log-probs of `ids` under the adapter it loaded from the folder `adapter`."""
    import aiohttp

    from agent_rl.rollout.serving.choose import serving_backend
    from agent_rl.rollout.serving.vllm.sampler import prompt_logprobs

    async def score() -> list[float]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            held = await serving_backend().adapters(http, url)
            served = next(name for name, root in held.items() if Path(root).resolve() == adapter.resolve())
            return await prompt_logprobs(http, url, served, ids)

    return torch.tensor(asyncio.run(score()))


def check(args) -> dict:
    from agent_rl.config.file import load_config
    from agent_rl.core.renderers.choose import load_renderer
    from agent_rl.learn.device import resolve_device, resolve_dtype
    from agent_rl.learn.logprobs import token_logprobs
    from agent_rl.learn.models import resolve_model
    from agent_rl.learn.policy import load_causal_lm
    from agent_rl.rollout.serving.choose import serving_backend
    from agent_rl.trainer import train

    run_dir = Path(tempfile.mkdtemp(prefix="agent-rl-gpu-check-"))
    cfg = load_config(None, ["model.name=smollm2-135m", "model.sync=adapter", "sampler.gpu_memory_utilization=0.3",
                             "rollout.env=toy", "rollout.tasks_per_step=4", "rollout.group_size=4",
                             "rollout.max_turns=1", "rollout.max_tokens_per_turn=48", "rollout.max_total_tokens=256",
                             "optim.lr=1e-3", "run.steps=2", f"run.run_dir={run_dir}", "run.tensorboard=false"])
    device = resolve_device(cfg.model.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    model_dir = resolve_model(cfg.model.name)
    with serving_backend().serve(cfg.model, cfg.sampler, cfg.run.seed, model_dir, run_dir / "vllm.log") as fleet:
        urls = fleet.urls
        attached = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"server_urls": urls})})
        t0 = time.perf_counter()
        final = asyncio.run(train(attached))
        train_s = time.perf_counter() - t0
        from peft import PeftModel

        adapter = run_dir / "adapters" / "v2"
        model = PeftModel.from_pretrained(load_causal_lm(str(model_dir), dtype).to(device), str(adapter)).eval()
        renderer = load_renderer(model_dir)
        ids = renderer.render([]) + renderer.encode("A fixed sequence to score on both sides, then compare.")
        with torch.no_grad():
            x = torch.tensor([ids], device=device)
            ours = token_logprobs(model, x, torch.ones_like(x)).logp_B_T[0, :-1].float().cpu()
        gap = (ours - served_logprobs(urls[0], adapter, ids)).abs()
    return {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "gpu": torch.cuda.get_device_name(0)
            if torch.cuda.is_available() else None, "train_s": round(train_s, 1), "steps": 2,
            "train_tokens": final.get("train_tokens"), "reward_mean": final.get("reward_mean"),
            "step_s": final.get("time/step_s"), "sampled_tok_per_step_s": final.get("tokens_per_s"),
            "logprob_gap_max": round(gap.max().item(), 5), "logprob_gap_mean": round(gap.mean().item(), 6),
            "run_dir": str(run_dir)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--allow-cpu", action="store_true", help="run the same path on the CPU (a dry run of the script)")
    args = ap.parse_args()

    def fail(text: str, why: str) -> int:
        print(f"FAIL: {text}")
        print(json.dumps({"bench": "gpu_check", "pass": False, "why": why}))
        return 1

    if not torch.cuda.is_available() and not args.allow_cpu:
        return fail("torch sees no CUDA device (torch.cuda.is_available() is False)", "no CUDA device")
    if importlib.util.find_spec("vllm") is None:
        return fail("vLLM is not installed in this Python (`make gpu-check BUILD=gpu` installs it); where it cannot "
                    "be, `python bench/gpu_trainer.py --model DIR` runs the trainer's half of this check without it",
                    "vllm not installed")
    try:
        figures = check(args)
    except Exception as e:  # a failed check is a report, not a traceback
        return fail(f"{type(e).__name__}: {e}", f"{type(e).__name__}: {e}")
    ok = figures["logprob_gap_max"] < MAX_GAP and figures["logprob_gap_mean"] < MEAN_GAP
    why = "" if ok else f": served vs trainer log-probs differ by {figures['logprob_gap_max']} (bound {MAX_GAP})"
    print(("PASS" if ok else "FAIL") + why)
    print(json.dumps({"bench": "gpu_check", "pass": ok, **figures}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
