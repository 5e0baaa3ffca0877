"""Cold-start supervised fine-tuning on demonstrations: the adapter a GRPO run starts from.

Owns: `sft(cfg)`, a short loop over `agent_rl.demos` files (shuffled batches, token-mean negative
log-likelihood of the assistant's tokens, AdamW), its checkpoints and metrics, and the final
`<sft.run_dir>/adapter` folder that `model.init_adapter` of a GRPO run points at.
Does not own: the demonstrations (`demos`), log-probs (`learn.logprobs`), tensors (`learn.batching`),
persistence (`runs.checkpoint`, `runs.runlog`): it is the GRPO trainer's machinery with a different loss.

Same policy, same numbers: the model is built by `learn.policy.build_policy`, as for GRPO (so LoRA
rank, targets and an `init_adapter` mean the same thing), log-probs come from
`learn.logprobs.token_logprobs` (chunked, at temperature 1), the mask is the demonstration's own
(tool outputs and prompts 0).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from agent_rl.config.file import dump_config
from agent_rl.config.train import TrainConfig
from agent_rl.core.files import write_text
from agent_rl.core.renderers.choose import load_renderer
from agent_rl.demos import Demo, read_demos
from agent_rl.learn.batching import collate, micro_batches
from agent_rl.learn.device import model_device
from agent_rl.learn.logprobs import token_logprobs
from agent_rl.learn.models import resolve_model
from agent_rl.learn.policy import build_policy
from agent_rl.learn.update import optimizer_step
from agent_rl.runs.checkpoint import load_checkpoint, save_checkpoint
from agent_rl.runs.runlog import RunLogger


def nll_step(model, demos: Sequence[Demo], pad_id: int, micro_batch_tokens: int, chunk: int,
             train: bool, share_prefixes: bool = False) -> tuple[float, int]:
    """Token-mean NLL of the masked tokens of `demos`; with `train`, gradients accumulate into `.grad`.

    Each micro-batch's sum is divided by the whole step's token count, so the accumulated gradient
    is that of the step's mean whatever the micro-batching. Returns (mean NLL, tokens).
    """
    batch = collate(demos, [0.0] * len(demos), pad_id)
    total = 0.0
    with torch.set_grad_enabled(train):
        for mb in micro_batches(batch, max_tokens=micro_batch_tokens, share_prefixes=share_prefixes):
            mb = mb.to(model_device(model))
            logp_B_T = token_logprobs(model, mb.input_ids_B_T, mb.attention_mask_B_T, 1.0, chunk,
                                      mb.loss_mask_B_T, share_prefixes).logp_B_T
            loss = -torch.where(mb.loss_mask_B_T, logp_B_T, 0.0).sum() / batch.step_num_tokens
            if train:
                loss.backward()
            total += float(loss.detach())
    return total, batch.step_num_tokens


def sft(cfg: TrainConfig, resume: bool = False) -> dict[str, float]:
    """Train the policy's adapter on `cfg.sft.demos`; returns the final metrics."""
    sft_cfg, optim = cfg.sft, cfg.optim
    run_dir = Path(sft_cfg.run_dir)
    demos = read_demos(sft_cfg.demos)  # fails before the model is loaded if broken
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text(run_dir / "config.yaml", dump_config(cfg))
    random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    model_dir = resolve_model(cfg.model.name)
    pad_id = load_renderer(model_dir, cfg.model.renderer).pad_token_id
    policy = build_policy(cfg.model, optim, model_dir, lr=sft_cfg.lr)
    model, optimizer, scheduler = policy.model, policy.optimizer, policy.scheduler
    # the schedule of batches is a pure function of the seed: a resumed run skips the steps done
    order = random.Random(cfg.run.seed)
    batches = []
    for _ in range(sft_cfg.epochs):
        idx = list(range(len(demos)))
        order.shuffle(idx)
        batches += [idx[i:i + sft_cfg.batch_size] for i in range(0, len(idx), sft_cfg.batch_size)]
    start = 0
    if resume and (ck := load_checkpoint(run_dir, model, optimizer, scheduler)) is not None:
        start = ck.step
    probe = demos[: min(len(demos), 16)]  # a fixed sample: the loss before and after, same rows
    model.eval()
    loss_before, _ = nll_step(model, probe, pad_id, optim.micro_batch_tokens, optim.logprob_chunk, train=False,
                              share_prefixes=policy.share_prefixes)
    final: dict[str, float] = {}
    with RunLogger(run_dir, len(batches), tensorboard=cfg.run.tensorboard, wandb_project=cfg.run.wandb_project,
                   start_step=start, collapse_drop=0.0, entropy_floor=0.0) as log:
        log.truncate_after(start)
        for step in range(start, len(batches)):
            t0 = time.perf_counter()
            model.train()
            optimizer.zero_grad(set_to_none=True)
            loss, tokens = nll_step(model, [demos[i] for i in batches[step]], pad_id, optim.micro_batch_tokens,
                                    optim.logprob_chunk, train=True, share_prefixes=policy.share_prefixes)
            grad_norm = optimizer_step(optimizer, optim.grad_clip)
            scheduler.step()
            final = log.log(step + 1, {"sft/loss": loss, "sft/perplexity": math.exp(min(loss, 50.0)),
                                       "grad_norm": grad_norm, "train_tokens": tokens,
                                       "lr": scheduler.get_last_lr()[0], "time/step_s": time.perf_counter() - t0,
                                       "epoch": step * sft_cfg.epochs / len(batches)})
            if (step + 1) % cfg.run.save_every == 0 or step + 1 == len(batches):
                save_checkpoint(run_dir, step + 1, model, optimizer, scheduler, data_position=step + 1,
                                keep=cfg.run.keep_checkpoints)
    model.eval()
    loss_after, _ = nll_step(model, probe, pad_id, optim.micro_batch_tokens, optim.logprob_chunk, train=False,
                              share_prefixes=policy.share_prefixes)
    model.save_pretrained(str(run_dir / "adapter"), safe_serialization=True)
    return {**final, "sft/loss_before": loss_before, "sft/loss_after": loss_after, "demos": float(len(demos))}

