"""The trainer's GPU path where vLLM and the weights cannot be had: a few GRPO steps on CUDA in bf16.

Owns: a model of the named architecture with random weights made to end its turns (`random_model`, `ends_turns`),
the bf16 against fp32 log-prob gap on the device (`bf16_gap`), GRPO steps of the real loop (`grpo_steps`) sampled
in-process (`HFSampler`: a copy of the policy generating with transformers, requests batched as they arrive;
`CopySync`: the adapter copied in after each update), and one row per `--model` (`measure`).
Does not own: the loop, the policy, the update, the checkpoint (agent_rl's, as `agent-rl train` runs them).

`bench/gpu_check.py` is the check to run on a CUDA machine (the trainer beside a vLLM server, on the real
weights); where neither can be had, this runs the rest of the same path for real, reading only each model
folder's config.json and tokenizer files. `logprob_gap_mean` is then the in-process sampler's log-probs against
the trainer's, not vLLM's. What it runs, its figures and where it ran: docs/performance.md#what-has-run-on-a-gpu.

    python bench/gpu_trainer.py --model DIR [DIR ...] [--steps 3] [--allow-cpu]
(one JSON line last)
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from agent_rl.core.renderers.base import Renderer
from agent_rl.core.types import Message
from agent_rl.rollout.sampler import Completion, SamplingParams

TEXT = ("The calculator returned 42, so the answer is the product of six and seven. Next, the search tool "
        "finds the capital of France, which is Paris, and the final answer cites both results. ")


class HFSampler:
    """A `Sampler` over a transformers model on the trainer's device: requests that arrive together are
    generated as one left-padded batch (`max_batch` at most) in a thread; a token's log-prob is read off
    the scores it was sampled from (the sampling distribution: temperature and top-p applied)."""

    def __init__(self, model: Any, renderer: Renderer, max_batch: int = 64):
        self.model, self.renderer, self.max_batch = model.eval(), renderer, max_batch
        self.policy_version = 0
        self.lock = threading.Lock()  # held while generating and while `CopySync` replaces the adapter
        self.pending: list[tuple[list[int], SamplingParams, asyncio.Future[Completion]]] = []
        self.worker: asyncio.Task[None] | None = None
        self.batches = 0  # generations run

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
                     messages: Sequence[Message] = ()) -> Completion:
        done: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self.pending.append((list(prompt_ids), params, done))
        if self.worker is None or self.worker.done():
            self.worker = asyncio.create_task(self._drain())
        return await asyncio.wait_for(done, timeout=600)

    async def _drain(self) -> None:
        while self.pending:
            await asyncio.sleep(0.01)  # the other requests of the round arrive
            batch, self.pending = self.pending[: self.max_batch], self.pending[self.max_batch:]
            try:
                self.batches += 1
                out = await asyncio.to_thread(self._generate, [(p, s) for p, s, _ in batch])
            except Exception as e:  # every waiter hears it
                for _, _, f in batch:
                    if not f.done():
                        f.set_exception(e)
                continue
            for (_, _, f), c in zip(batch, out):
                if not f.done():
                    f.set_result(c)

    @torch.no_grad()
    def _generate(self, requests: list[tuple[list[int], SamplingParams]]) -> list[Completion]:
        first = requests[0][1]
        stops = set(first.stop_token_ids or self.renderer.stop_token_ids)
        pad, width = self.renderer.pad_token_id, max(len(p) for p, _ in requests)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in requests])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in requests])
        device = next(self.model.parameters()).device
        with self.lock:
            version = self.policy_version
            if first.seed is not None:
                torch.manual_seed(first.seed)
            out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                                      temperature=first.temperature, top_p=first.top_p, top_k=0,
                                      max_new_tokens=max(s.max_tokens for _, s in requests),
                                      eos_token_id=sorted(stops), pad_token_id=pad, output_scores=True,
                                      return_dict_in_generate=True)
        new = out.sequences[:, width:].cpu()
        logp = torch.stack([s.float().log_softmax(-1) for s in out.scores], 1)  # B, steps, V
        picked = logp.gather(-1, new[:, : logp.shape[1]].to(logp.device).unsqueeze(-1)).squeeze(-1).cpu()
        completions = []
        for row, (_, params) in enumerate(requests):
            toks, finish = new[row].tolist()[: params.max_tokens], "length"
            end = next((i for i, t in enumerate(toks) if t in stops), None)
            if end is not None:
                toks, finish = toks[: end + 1], "stop"
            completions.append(Completion(tuple(toks), tuple(picked[row, : len(toks)].tolist()), finish, version))
        return completions


class CopySync:
    """A `WeightSync` into `HFSampler`'s copy of the policy: the trainer's adapter weights copied in (under the
    sampler's lock, between two generations), then the version new requests are tagged with."""

    def __init__(self, sampler: HFSampler):
        self.sampler = sampler

    async def push(self, model: Any, version: int) -> float:
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        t0 = time.perf_counter()

        def copy_in() -> None:
            with self.sampler.lock:
                set_peft_model_state_dict(self.sampler.model, get_peft_model_state_dict(model))
                self.sampler.policy_version = version

        await asyncio.to_thread(copy_in)
        return time.perf_counter() - t0

    async def restore(self, url: str) -> None:
        return None

    async def finish(self) -> None:
        return None


def random_model(source: Path, dest: Path, stop_id: int, dtype: torch.dtype) -> float:
    """`dest`: `source`'s config and tokenizer files, weights drawn at random (seed 0) and made to end a turn
    (`ends_turns`); returns millions of parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dest.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".gguf", ".pt")):
            shutil.copy(f, dest / f.name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(source)), dtype=torch.float32)
    print(f"{source.name}: the stop token's mean probability {ends_turns(model, stop_id):.3f}", file=sys.stderr)
    model.to(dtype).save_pretrained(str(dest), safe_serialization=True)
    return sum(p.numel() for p in model.parameters()) / 1e6


@torch.no_grad()
def ends_turns(model: Any, stop_id: int, p_stop: float = 0.08, lift: float = 0.1) -> float:
    """A random model almost never samples its stop token (1 in the vocabulary), so every reply would be cut at
    the limit and masked out of the loss. One embedding coordinate set to `lift` for every token (5x the
    init's spread) keeps one sign in the hidden state the output layer reads, coordinate 0 (`h_0`); the
    stop token's output row gets `b` more there, `b` found by bisection so that the stop token's mean
    probability over a random probe is `p_stop`: replies of ~1 / p_stop tokens, whose lengths, and so the
    toy env's rewards, differ. The architecture stays the model's own. Returns that mean probability."""
    emb, out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    emb[:, 0] = lift
    seen: list[torch.Tensor] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda mod, args, res: seen.append(args[0]))
    try:
        logits = model(torch.randint(0, emb.shape[0], (4, 64))).logits.float()
    finally:
        hook.remove()
    h_0 = seen[0][..., 0].float()

    def p_at(b: float) -> float:
        lifted = logits.clone()
        lifted[..., stop_id] += b * h_0
        return lifted.softmax(-1)[..., stop_id].mean().item()

    lo, hi = 0.0, 1.0
    while p_at(hi) < p_stop and hi < 1e4:
        hi *= 2
    for _ in range(40):
        lo, hi = ((lo + hi) / 2, hi) if p_at((lo + hi) / 2) < p_stop else (lo, (lo + hi) / 2)
    out[stop_id, 0] += hi
    return p_at(hi)


def bf16_gap(model_dir: Path, renderer: Renderer, device: torch.device) -> tuple[float, float]:
    """Max and mean |bf16 - fp32| of the trainer's log-probs of a fixed ~500-token sequence, both on `device`."""
    from agent_rl.learn.logprobs import token_logprobs
    from agent_rl.learn.policy import load_causal_lm

    ids = renderer.render([Message("user", "Summarise the tool results.")]) + renderer.encode(TEXT * 12)
    x = torch.tensor([ids], device=device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        logps = []
        for dtype in (torch.float32, torch.bfloat16):
            model: Any = load_causal_lm(str(model_dir), dtype)
            model = model.to(device).eval()
            with torch.no_grad():
                logps.append(token_logprobs(model, x, torch.ones_like(x)).logp_B_T[0, :-1].float().cpu())
            del model
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    gap = (logps[0] - logps[1]).abs()
    return gap.max().item(), gap.mean().item()


async def grpo_steps(model_dir: Path, run_dir: Path, steps: int, device: str) -> tuple[list[dict[str, float]], bool]:
    """`steps` steps of the real loop on the toy env, sampled by `HFSampler`; each step's metrics, and whether
    the run's last checkpoint was written."""
    from agent_rl import trainer
    from agent_rl.config.file import load_config
    from agent_rl.rollout.players import LocalPlayers
    from agent_rl.runs.runlog import RunLogger

    cfg = load_config(None, [f"model.name={model_dir}", "model.sync=adapter", f"model.device={device}",
                             "rollout.env=toy", "rollout.tasks_per_step=16", "rollout.group_size=8",
                             "rollout.max_turns=1", "rollout.max_tokens_per_turn=48", "rollout.max_total_tokens=256",
                             "optim.lr=2e-5", f"run.steps={steps}", f"run.save_every={steps}", f"run.run_dir={run_dir}",
                             "run.tensorboard=false", "run.trace_groups=0"])
    run = trainer.prepare(cfg)
    sampler = HFSampler(copy.deepcopy(run.policy.model), run.session.renderer)
    sync = CopySync(sampler)
    await sync.push(run.policy.model, 0)
    with RunLogger(run_dir, steps, tensorboard=False, progress=False) as log:
        players = LocalPlayers(run.session.env.make_env, sampler, run.session.renderer)
        await trainer.loop(run, players, sync, log, trainer.Stages())
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return lines, any((run_dir / "checkpoints").glob("*"))  # a folder that is not there globs to nothing


def measure(source: Path, steps: int, device: torch.device, work: Path) -> dict[str, Any]:
    from agent_rl.core.renderers.choose import load_renderer

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_dir = work / f"{source.name}-random"
    params_m = random_model(source, model_dir, load_renderer(source).stop_token_ids[0], dtype)
    renderer = load_renderer(model_dir)
    gap_max, gap_mean = bf16_gap(model_dir, renderer, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    lines, saved = asyncio.run(grpo_steps(model_dir, work / f"{source.name}-run", steps, device.type))
    wall = time.perf_counter() - t0
    timed = lines[1:] if len(lines) >= 3 else lines  # the first step warms up

    def med(key: str) -> float | None:
        vals = [x[key] for x in timed if key in x]
        return round(statistics.median(vals), 6) if vals else None

    update_s = med("time/train_s")
    batch_tok = med("train_tokens")
    return {"model": source.name, "params_m": round(params_m, 1), "bf16_gap_max": round(gap_max, 5),
            "bf16_gap_mean": round(gap_mean, 6), "steps": len(lines), "wall_s": round(wall, 1),
            "step_s": med("time/step_s"), "update_s": update_s, "sync_s": med("time/sync_s"),
            "update_tok_per_s": round(batch_tok / update_s) if batch_tok and update_s else None,
            "sampled_tok_per_s": med("tokens_per_s"), "computed_token_share": med("computed_token_share"),
            "entropy": med("entropy"), "logprob_gap_mean": med("logprob_gap_mean"),
            "loss": [x.get("loss") for x in lines], "reward_mean": [x.get("reward_mean") for x in lines],
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
            "checkpoint_written": saved}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", nargs="+", type=Path, required=True, help="model folders (config.json + tokenizer)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--allow-cpu", action="store_true", help="run the same path on the CPU, in float32 (a dry run)")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("FAIL: torch sees no CUDA device (torch.cuda.is_available() is False)")
        return 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    card = torch.cuda.get_device_name(0) if device.type == "cuda" else None
    rows = []
    with tempfile.TemporaryDirectory(prefix="agent-rl-gpu-trainer-") as tmp:
        for source in args.model:
            if not (source / "config.json").is_file():
                print(f"FAIL: {source} has no config.json")
                return 1
            row = measure(source, args.steps, device, Path(tmp))
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    print(json.dumps({"bench": "gpu_trainer", "device": str(device), "card": card, "torch": torch.__version__,
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
