"""The GRPO training loop, in data-flow order: sample, score, advantages, batch, loss, step, sync, log.

Owns: `train(cfg)`, the loop, and the small helpers it needs to read in one pass (building the
policy and optimizer, the task stream with its saved position, DAPO-style resampling).
Does not own: any of the maths (`advantages`, `loss`, `update`), tokens (`rollout`, `chat`),
servers (`server`), weight transport (`weight_sync`), persistence (`checkpoint`, `runlog`).

State is passed, not read from globals: the step, the data position and the RNG states live in
checkpoints, so `resume=True` continues a killed run from its last complete step.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from agent_rl import advantages as A
from agent_rl.batching import collate
from agent_rl.chat import ChatRenderer
from agent_rl.checkpoint import load_checkpoint, save_checkpoint
from agent_rl.config import TrainConfig, dump_config
from agent_rl.metrics import rollout_metrics
from agent_rl.models import resolve_model
from agent_rl.policy import apply_lora, enable_full_finetune, load_causal_lm, trainable_parameters
from agent_rl.rollout import EpisodeLimits, rollout_groups
from agent_rl.runlog import RunLogger
from agent_rl.sampler import VLLMSampler
from agent_rl.server import VLLMServer, attach
from agent_rl.types import TrajectoryGroup
from agent_rl.update import policy_update
from agent_rl.weight_sync import AdapterSync, FullWeightSync
from envs.registry import load_env

ADVANTAGES = {"grpo": A.grpo_advantages, "dr_grpo": A.dr_grpo_advantages, "rloo": A.rloo_advantages}


@dataclass
class TaskStream:
    """Tasks in a fixed shuffled order; `position` is what a checkpoint saves."""

    tasks: list[dict[str, Any]]
    position: int = 0

    def take(self, n: int) -> list[dict[str, Any]]:
        out = [self.tasks[(self.position + i) % len(self.tasks)] for i in range(n)]
        self.position += n
        return out


def build_policy(cfg: TrainConfig, model_dir: Path):
    model = load_causal_lm(str(model_dir))
    if cfg.model.full_finetune:
        model = enable_full_finetune(model)
    elif cfg.model.init_adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, cfg.model.init_adapter, is_trainable=True)
    else:
        model = apply_lora(model, rank=cfg.model.lora_rank, alpha=cfg.model.lora_alpha,
                           dropout=cfg.model.lora_dropout, target_modules=cfg.model.target_modules)
    o = cfg.optim
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=o.lr, betas=(o.beta1, o.beta2),
                                  weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / o.warmup_steps) if o.warmup_steps else 1.0)
    return model, optimizer, scheduler


async def sample_step(stream: TaskStream, cfg: TrainConfig, make_env, sampler, renderer, limits, step: int):
    """Rollouts for one step; with dynamic sampling, groups without reward variance are replaced.

    Sampling seeds derive from (run seed, step, batch): a resumed run draws the same rollouts.
    """
    t0 = time.perf_counter()
    r, algo = cfg.rollout, cfg.algorithm

    def seeded(batch: int) -> EpisodeLimits:
        return replace(limits, seed=(cfg.run.seed * 1_000_003 + step) * 101 + batch)
    groups = await rollout_groups(stream.take(r.tasks_per_step), make_env, sampler, renderer, seeded(0),
                                  r.group_size, r.max_concurrent)
    extra = 0
    while algo.dynamic_sampling and extra < algo.max_resample_batches:
        flat = [g for g in groups if not A.has_signal(g, algo.truncated_reward)]
        if not flat:
            break
        extra += 1
        more = await rollout_groups(stream.take(len(flat)), make_env, sampler, renderer, seeded(extra),
                                    r.group_size, r.max_concurrent)
        groups = [g for g in groups if A.has_signal(g, algo.truncated_reward)] + more
    return groups, {"time/rollout_s": time.perf_counter() - t0, "resample_batches": float(extra)}


async def train(cfg: TrainConfig, resume: bool = False) -> dict[str, float]:
    run_dir = Path(cfg.run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    model_dir = resolve_model(cfg.model.name)
    renderer = ChatRenderer.from_pretrained(model_dir)
    spec = load_env(cfg.rollout.env)
    r = cfg.rollout
    pool = spec.load_tasks(r.tasks_per_step * cfg.run.steps * (1 + cfg.algorithm.max_resample_batches),
                           seed=cfg.run.seed, split="train")
    stream = TaskStream(pool)
    model, optimizer, scheduler = build_policy(cfg, model_dir)
    start = 0
    if resume and (ck := load_checkpoint(run_dir, model, optimizer, scheduler)) is not None:
        start, stream.position = ck.step, ck.data_position
    limits = EpisodeLimits(max_turns=r.max_turns, max_tokens_per_turn=r.max_tokens_per_turn,
                           max_total_tokens=r.max_total_tokens, temperature=cfg.sampler.temperature,
                           top_p=cfg.sampler.top_p)
    server = None
    if cfg.sampler.server_urls:
        urls = [attach(u) for u in cfg.sampler.server_urls]
    else:
        server = VLLMServer(model_dir, max_lora_rank=max(cfg.model.lora_rank, 8), kv_cache_gib=cfg.sampler.kv_cache_gib,
                            max_model_len=cfg.sampler.max_model_len, seed=cfg.run.seed,
                            dev_mode=cfg.model.full_finetune,
                            log_path=run_dir / "vllm.log").start()
        urls = [server.url]
    final: dict[str, float] = {}
    try:
        async with VLLMSampler(urls, request_timeout_s=cfg.sampler.request_timeout_s) as sampler:
            # adapter names unique to this process: a long-lived server may hold an earlier run's
            prefix = f"policy-{os.getpid()}-{secrets.token_hex(3)}"
            sync = (FullWeightSync(run_dir, sampler) if cfg.model.full_finetune
                    else AdapterSync(run_dir, sampler, prefix=prefix))
            await sync.push(model, start)  # the server samples with exactly the trainer's weights
            with RunLogger(run_dir, cfg.run.steps, tensorboard=cfg.run.tensorboard,
                           wandb_project=cfg.run.wandb_project, start_step=start,
                           collapse_drop=cfg.run.collapse_drop, entropy_floor=cfg.run.entropy_floor) as log:
                log.truncate_after(start)
                pending = None
                for step in range(start, cfg.run.steps):
                    t_step = time.perf_counter()
                    # 1. sample (overlapped: these rollouts started while the previous step trained)
                    job = pending or asyncio.create_task(
                        sample_step(stream, cfg, spec.make_env, sampler, renderer, limits, step))
                    groups, timing = await job
                    pending = None
                    if cfg.algorithm.overlap_rollouts and step + 1 < cfg.run.steps:
                        pending = asyncio.create_task(
                            sample_step(stream, cfg, spec.make_env, sampler, renderer, limits, step + 1))
                    trajs = [t for g in groups for t in g.trajectories]
                    # 2. score: rewards came back with each trajectory (env.reward); 3. advantages
                    adv = A.group_advantages(groups, ADVANTAGES[cfg.algorithm.advantage],
                                             cfg.algorithm.truncated_reward)
                    metrics = {**rollout_metrics(trajs), **timing, **_group_metrics(groups, adv)}
                    t_train = time.perf_counter()
                    if adv.trajectories:
                        # 4. batch, 5. loss + backward, 6. optimizer step (in a thread: rollouts go on)
                        batch = collate(adv.trajectories, adv.advantages,
                                        renderer.tokenizer.pad_token_id or 0)
                        stats = await asyncio.to_thread(
                            policy_update, model, optimizer, batch, cfg.algorithm, cfg.optim,
                            cfg.sampler.temperature, cfg.algorithm.overlap_rollouts)
                        scheduler.step()
                        metrics.update(stats)  # entropy, kl, clip_frac, grad_norm...: the alarm reads them
                    metrics["time/train_s"] = time.perf_counter() - t_train
                    # 7. sync the new weights into every server (version = number of steps taken)
                    metrics["time/sync_s"] = await sync.push(model, step + 1)
                    # 8. log and checkpoint
                    metrics["time/step_s"] = time.perf_counter() - t_step
                    metrics["tokens_per_s"] = sum(t.num_sampled for t in trajs) / max(metrics["time/step_s"], 1e-9)
                    metrics["lr"] = scheduler.get_last_lr()[0]
                    log.log(step + 1, metrics)
                    if (step + 1) % cfg.run.save_every == 0 or step + 1 == cfg.run.steps:
                        # with overlap, the in-flight rollouts' tasks are re-drawn after a resume
                        position = stream.position - (cfg.rollout.tasks_per_step if pending else 0)
                        save_checkpoint(run_dir, step + 1, model, optimizer, scheduler, data_position=position,
                                        keep=cfg.run.keep_checkpoints)
                    final = metrics
                if pending:
                    pending.cancel()
            if not cfg.model.full_finetune:  # the final policy, where `agent-rl eval --adapter RUN_DIR` finds it
                model.save_pretrained(run_dir / "adapter", safe_serialization=True)
    finally:
        if server:
            server.stop()
    return final


def _group_metrics(groups: list[TrajectoryGroup], adv: A.GroupAdvantages) -> dict[str, float]:
    usable = [t.reward for g in groups for t in g.trajectories if not t.infra_error]
    mean = sum(usable) / len(usable) if usable else 0.0
    std = (sum((x - mean) ** 2 for x in usable) / len(usable)) ** 0.5 if usable else 0.0
    return {"reward_std": std, "zero_variance_group_share": adv.num_zero_variance_groups / max(len(groups), 1),
            "kept_trajectories": float(len(adv.trajectories)), "dropped_trajectories": float(adv.num_dropped_trajectories)}
