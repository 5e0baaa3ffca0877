"""The GRPO training loop, in data-flow order: sample, score, advantages, batch, loss, step, sync, log.

Owns: `train(cfg)`: set-up (run directory, seeds, session, policy, tasks, resume) and the loop;
`Stages`, the loop's replaceable parts, each typed by its protocol (`StreamStage`, `AdvantageStage`,
`UpdateStage`, `SyncStage`; a bench times them, a test scripts them, by argument); `open_stream`, the
run's rollout stream on rank 0 as the config sets it (staleness, dynamic sampling's refills); under
torchrun, what the other ranks do (`follow`) and the collectives every rank joins for a weight push and
a checkpoint (`served_weights`, `checkpoint`); what the loop does on a stop (`stop`: the step being sampled
abandoned, the last completed one checkpointed).
Does not own: signals, whether a faulted step may be checkpointed and the line a stopped run ends with
(`stopping`), any of the maths (`learn.advantages`, `learn.loss`,
`learn.update`), tokens (`rollout.runner`, `core.renderers.base`), which groups a step trains and when they are played
(`rollout.stream`, `rollout.admission`), servers (`rollout.serving`), weight transport
(`rollout.weight_sync`), persistence (`runs.checkpoint`, `runs.runlog`, `runs.traces`).

State is passed, not read from globals: the step, the stream's state (task position, the slots not yet
trained) and the RNG states live in checkpoints, so `resume=True` continues a killed run from its last
complete step, no task skipped and none trained twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from agent_rl.config.file import dump_config
from agent_rl.config.train import TrainConfig
from agent_rl.core.config import ModelConfig, OptimConfig, RolloutConfig
from agent_rl.core.files import write_text
from agent_rl.core.seeds import step_seed
from agent_rl.core.types import TrajectoryGroup
from agent_rl.learn.advantages import ESTIMATORS, AdvantageFn, CreditRule, GroupAdvantages, group_advantages, has_signal
from agent_rl.learn.algorithm import AlgorithmConfig, credit_of
from agent_rl.learn.batching import Batch, collate
from agent_rl.learn.credit import credit_metrics
from agent_rl.learn.distributed import (
    Dist,
    GatheredModel,
    broadcast,
    close_distributed,
    full_optimizer_state,
    full_state_dict,
    init_distributed,
)
from agent_rl.learn.policy import Policy, build_policy
from agent_rl.learn.update import policy_update
from agent_rl.rollout.admission import Admission
from agent_rl.rollout.players import Players
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.rollout.sampler import ServedSampler
from agent_rl.rollout.stream import Batch as StreamBatch
from agent_rl.rollout.stream import RolloutStream, TaskStream, resumable
from agent_rl.rollout.supervisor import Supervisor
from agent_rl.rollout.weight_sync.base import WeightSync, WeightSyncError
from agent_rl.rollout.weight_sync.choose import start_weight_sync
from agent_rl.runs.checkpoint import CheckpointError, latest_step, load_checkpoint, save_checkpoint
from agent_rl.runs.metrics import branch_metrics, lag_metrics, rollout_metrics, tool_decision_metrics
from agent_rl.runs.runlog import RunLogger
from agent_rl.runs.traces import truncate_after as truncate_traces
from agent_rl.runs.traces import write_step as write_traces
from agent_rl.session import Session, episodes, judging, open_session, supervised_sampling
from agent_rl.stopping import Preemption, end_of_run, mended, server_gone, unless_stopped, watch

T = TypeVar("T")


class StreamStage(Protocol):
    """The run's rollout stream, its episodes played by `players`, not yet started: `open_stream`."""

    def __call__(self, run: Run, players: Players, /) -> RolloutStream: ...


class AdvantageStage(Protocol):
    """Each group's advantages by `advantage_fn`, groups without signal dropped, and with `credit` each turn's
    (`learn.credit`; None: one per trajectory): `learn.advantages.group_advantages`."""

    def __call__(self, groups: Sequence[TrajectoryGroup], advantage_fn: AdvantageFn, credit: CreditRule | None, /
                 ) -> GroupAdvantages: ...


class UpdateStage(Protocol):
    """The optimizer steps on one batch, run in a thread; returns their statistics: `learn.update.policy_update`
    (`seed`: the step's, which shuffles mini-batches, `core.seeds.step_seed`; `version`: the policy version
    the update starts from, which the batch's per-token versions lag behind)."""

    def __call__(self, policy: Policy, batch: Batch, algo: AlgorithmConfig, optim: OptimConfig, temperature: float,
                 seed: int, version: int, /) -> dict[str, float]: ...


class SyncStage(Protocol):
    """The run's weight sync, with `model` already pushed as `version`: `rollout.weight_sync.start_weight_sync`."""

    async def __call__(self, model_cfg: ModelConfig, rollout: RolloutConfig, max_staleness: int, run_dir: Path,
                       sampler: ServedSampler, model: Any, version: int, /) -> WeightSync: ...


def open_stream(run: Run, players: Players) -> RolloutStream:
    """Rank 0's rollout stream: slots by `algorithm.max_staleness` (as the checkpoint left them, when resuming),
    each group a task of `run.tasks` played on `players` as every command plays a group (`session.episodes`); with
    dynamic sampling, a group without signal gives its slot to the next task (`learn.advantages.has_signal`)."""
    cfg, algo, rollout = run.cfg, run.cfg.algorithm, run.cfg.rollout
    shape = (rollout.tasks_per_step, algo.max_staleness, cfg.run.steps, algo.slots_ahead(rollout.tasks_per_step))
    admission = Admission.from_json(run.saved, *shape) if run.saved is not None else Admission(*shape)
    played = episodes(run.session, players, run.limits, rollout.group_size, training=True)
    return RolloutStream(run.tasks, played, admission, run_seed=cfg.run.seed, max_concurrent=rollout.max_concurrent,
                         max_rounds=algo.max_resample_batches, signal=has_signal if algo.dynamic_sampling else None)


@dataclass(frozen=True)
class Stages:
    """The loop's stages, replaceable by argument (a bench wraps them in timers, a test scripts them)."""

    stream: StreamStage = open_stream
    advantages: AdvantageStage = group_advantages
    update: UpdateStage = policy_update
    sync: SyncStage = start_weight_sync


@dataclass
class Run:
    """What the loop reads: the config, the session, the policy (model, optimizer, reference), the tasks."""

    cfg: TrainConfig
    run_dir: Path
    session: Session
    policy: Policy
    tasks: TaskStream
    limits: EpisodeLimits
    start: int = 0  # steps already done (resumed)
    saved: dict[str, Any] | None = None  # the rollout stream's state in the checkpoint resumed from
    stop: Preemption = field(default_factory=Preemption)  # set by SIGTERM / SIGUSR1 while the loop runs (`stopping`)
    supervisor: Supervisor | None = None  # of the servers (rank 0 of `train`): restarts counted each step


def prepare(cfg: TrainConfig, resume: bool = False, dist: Dist = Dist()) -> Run:
    """Run directory and config copy, seeds, session, policy (this rank's, under torchrun), task stream;
    restored from the last checkpoint when resuming (every rank reads the same one)."""
    run_dir = Path(cfg.run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if dist.main:
        write_text(run_dir / "config.yaml", dump_config(cfg))
    random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    session = open_session(cfg)
    rollout = cfg.rollout
    pool = session.env.load_tasks(rollout.tasks_per_step * cfg.run.steps * (1 + cfg.algorithm.max_resample_batches),
                                  seed=cfg.run.seed, split="train")
    # the KL reference is the starting policy: made before a checkpoint is loaded into the model
    policy = build_policy(cfg.model, cfg.optim, session.model_dir, with_reference=cfg.algorithm.kl_beta > 0,
                          dist=dist)
    limits = EpisodeLimits.from_config(rollout, cfg.sampler.temperature, cfg.sampler.top_p)
    run = Run(cfg, run_dir, session, policy, TaskStream(pool), limits)
    if resume and (ck := load_checkpoint(run_dir, policy.model, policy.optimizer, policy.scheduler)) is not None:
        run.start = ck.step
        run.saved = resumable(ck.data_position)
    return run


async def train(cfg: TrainConfig, resume: bool = False, stages: Stages = Stages()) -> dict[str, float]:
    """Train a policy with GRPO as `cfg` says; returns the last step's metrics (rank 0's; {} on the other
    ranks of a torchrun job, which train their share of each batch: `follow`)."""
    dist = init_distributed(cfg.model.device)
    cfg = for_ranks(cfg, dist)
    run = prepare(cfg, resume, dist)
    first = served_weights(run)  # every rank: under sharded full fine-tuning, a gather on rank 0
    if not dist.main:
        await follow(run, stages)
        close_distributed(dist)
        return {}
    # the session's group rewards gain the LLM judge of `cfg.judge`, if any (`judge.url: run`: these servers)
    async with supervised_sampling(run.session, run.run_dir / "vllm.log") as (served, supervisor), \
            judging(run.session, served.sampler.urls, run.run_dir) as run.session:
        # the servers sample with exactly the trainer's weights from the first step on
        sync = await stages.sync(cfg.model, cfg.rollout, cfg.algorithm.max_staleness, run.run_dir, served.sampler,
                                 first, run.start)
        del first
        # from here a server that dies comes back with the current weights; one that cannot stops the loop
        run.supervisor = supervisor
        supervisor.start(sync.restore, run.stop.fail)
        with RunLogger(run.run_dir, cfg.run.steps, tensorboard=cfg.run.tensorboard,
                       wandb_project=cfg.run.wandb_project, start_step=run.start,
                       collapse_drop=cfg.run.collapse_drop, entropy_floor=cfg.run.entropy_floor) as log:
            log.truncate_after(run.start)
            truncate_traces(run.run_dir, run.start)  # a fresh run (start 0) drops an earlier run's traces
            try:
                with watch(run.stop):
                    final = await loop(run, served.players, sync, log, stages)
            except BaseException:
                with contextlib.suppress(Exception):  # the run's own error is the one to report
                    await sync.finish()
                raise
            await sync.finish()  # merged weights: the servers' own base weights back
    if not cfg.model.full_finetune:  # the final policy, where `agent-rl eval --adapter RUN_DIR` finds it
        run.policy.model.save_pretrained(str(run.run_dir / "adapter"), safe_serialization=True)
    close_distributed(dist)
    return final


async def loop(run: Run, players: Players, sync: WeightSync, log: RunLogger, stages: Stages) -> dict[str, float]:
    """Steps `run.start` .. `run.cfg.run.steps`, the episodes played by `players`; returns the last step's metrics.
    On a stop (`run.stop`, `stopping`): a step still sampling is abandoned, one past its sampling is finished, then
    the last completed step is checkpointed (if it is not already) and the run ends with `stopping.end_of_run`."""
    cfg, final, done = run.cfg, {}, run.start
    async with stages.stream(run, players) as stream:
        stream.start(run.start, run.saved)  # the slots the served version opens (a checkpoint's, resumed)
        for step in range(run.start, cfg.run.steps):
            t_step = time.perf_counter()
            # 1. sample: the stream's groups for this step (ended; it waits only for what the staleness bound needs)
            sampled = await unless_stopped(stream.batch(step), run.stop)
            if sampled is None:
                break  # preempted while sampling: the step is abandoned, its groups stay open in the stream
            final, done = await train_step(run, stream, sync, log, stages, step, sampled, t_step), step + 1
            if run.stop.requested:
                break
        if run.stop.requested and done < cfg.run.steps:  # a signal in the last step: the run ends as it would
            stop(run, done, stream.state())
    return final


async def train_step(run: Run, stream: RolloutStream, sync: WeightSync, log: RunLogger, stages: Stages, step: int,
                     sampled: StreamBatch, t_step: float) -> dict[str, float]:
    """Steps 2-8 of one step on its sampled groups; returns its metrics as logged."""
    cfg, algo, groups = run.cfg, run.cfg.algorithm, sampled.groups
    metrics = {**sampled.metrics, **sampled.failures.metrics()}
    trajs = [t for g in groups for t in g.trajectories]
    # 2. score: rewards and returns came back with each trajectory (env.reward, + group rewards, each turn's own)
    # 3. advantages: one per trajectory, or with credit per turn one per turn (algorithm.credit)
    credit = credit_of(algo)
    adv = stages.advantages(groups, ESTIMATORS[algo.advantage].advantages, credit)
    own = [t for t in trajs if t.branch is None]  # the policy's own episodes; branches are counted apart
    threshold = cfg.eval.success_threshold
    metrics.update({**rollout_metrics(own, threshold), **tool_decision_metrics(groups, threshold),
                    **branch_metrics(groups, threshold), **group_metrics(groups, adv),
                    **lag_metrics(adv.trajectories, step), **credit_metrics(adv, credit)})
    t_train = time.perf_counter()
    # 4. batch (sent to every rank), 5. loss + backward, 6. optimizer step (the stream plays on meanwhile)
    pad = run.session.renderer.pad_token_id
    batch = collate(adv.trajectories, adv.advantages, pad, adv.turn_advantages) if adv.trajectories else None
    metrics.update(await learn(run, batch, stages, step))
    metrics["time/train_s"] = time.perf_counter() - t_train
    # 7. sync the new weights into every server (version = steps taken), episodes in flight or not;
    # the new version opens the stream's next slots
    t_sync, metrics["push/episodes_in_flight"] = time.perf_counter(), float(stream.in_flight)
    failed = await push(run, sync, stream, step + 1)
    metrics["time/sync_s"] = time.perf_counter() - t_sync
    # 8. log and checkpoint
    metrics["time/step_s"] = time.perf_counter() - t_step
    metrics["tokens_per_s"] = sum(t.num_sampled for t in trajs) / max(metrics["time/step_s"], 1e-9)
    metrics["lr"] = float(run.policy.scheduler.get_last_lr()[0])
    metrics.update(run.supervisor.metrics() if run.supervisor is not None else {})  # fault/restarts, ...
    metrics.update(run.tasks.positions(stream.data_position()))
    final = log.log(step + 1, metrics)
    write_traces(run.run_dir, step + 1, groups, adv, run.session.renderer, cfg.run.trace_groups)
    saved = checkpoint_due(cfg, step) or (failed is not None and mended(sampled.failures, trajs)
                                          and not sharded_full(run))
    if saved:
        checkpoint(run, step + 1, stream.state())
    if failed is not None:
        raise server_gone(run.run_dir, failed, step + 1 if saved else None)
    return final


async def push(run: Run, sync: WeightSync, stream: RolloutStream, version: int) -> WeightSyncError | None:
    """Push `version` to every server and open the slots it allows; the error if a server would not take it
    (a server gone: the run ends after this step is logged and, when it can be, checkpointed)."""
    try:
        await sync.push(await asyncio.to_thread(served_weights, run), version)
    except WeightSyncError as e:
        return e
    stream.pushed(version)
    return None


def stop(run: Run, done: int, stream_state: dict[str, Any]) -> None:
    """A stop came (a signal, or a server that cannot be mended: `stopping.Preemption`): checkpoint step `done`
    unless it is already (the slots not yet trained are the stream's now, as no update happened since), then end
    the run with the stop's line."""
    saved = done > 0 and (done == run.start or checkpoint_due(run.cfg, done - 1))
    if done > 0 and not saved:
        checkpoint(run, done, stream_state)
    raise end_of_run(run.stop, done, run.cfg.run.steps, run.run_dir)


async def learn(run: Run, batch: Batch | None, stages: Stages, step: int) -> dict[str, float]:
    """Rank 0's batch (None: nothing to learn from) on every rank, then the update, in a thread (the rollout
    stream goes on meanwhile) and the schedule's step. Returns the update's statistics."""
    cfg = run.cfg
    batch = broadcast(batch, run.policy.dist)
    if batch is None:
        return {}
    # the weights are version `step` (a version is the number of steps taken): tokens the stream sampled before
    # the last pushes lag behind it, which the update's decoupled correction weighs (`learn.update`)
    stats = await asyncio.to_thread(stages.update, run.policy, batch, cfg.algorithm, cfg.optim,
                                    cfg.sampler.temperature, step_seed(cfg.run.seed, step), step)
    run.policy.scheduler.step()
    return stats


async def follow(run: Run, stages: Stages) -> None:
    """The ranks other than 0: each step, rank 0's batch and their share of the update, then the same
    collectives as rank 0's push and checkpoint (gathers under sharded full fine-tuning; a LoRA adapter is
    replicated, so then nothing)."""
    for step in range(run.start, run.cfg.run.steps):
        await learn(run, None, stages, step)
        served_weights(run)
        if checkpoint_due(run.cfg, step):
            checkpoint(run, step + 1, None)


def sharded_full(run: Run) -> bool:
    """Full fine-tuning over several ranks: the trained layers are sharded (`learn.distributed`)."""
    return run.cfg.model.full_finetune and run.policy.dist.active


def served_weights(run: Run) -> Any:
    """What rank 0 pushes to the servers: the model, or under sharded full fine-tuning its weights gathered
    whole on rank 0 (`GatheredModel`). Every rank calls it at the same points: the gather is a collective."""
    model = run.policy.model
    if not sharded_full(run):
        return model
    return GatheredModel(full_state_dict(model, run.policy.dist), model.config,
                         getattr(model, "generation_config", None))


def checkpoint_due(cfg: TrainConfig, step: int) -> bool:
    return (step + 1) % cfg.run.save_every == 0 or step + 1 == cfg.run.steps


def checkpoint(run: Run, step: int, stream: dict[str, Any] | None) -> None:
    """Checkpoint `step`, written by rank 0. Every rank calls it: under sharded full fine-tuning the weights
    and the optimizer state are first gathered whole on rank 0, into the format one process writes."""
    policy, gathered = run.policy, {}
    if sharded_full(run):
        gathered = {"weights": full_state_dict(policy.model, policy.dist),
                    "optimizer_state": full_optimizer_state(policy.optimizer, policy.dist)}
    if not policy.dist.main:
        return
    try:
        save_checkpoint(run.run_dir, step, policy.model, policy.optimizer, policy.scheduler,
                        data_position=stream, keep=run.cfg.run.keep_checkpoints, **gathered)
    except OSError as e:  # a full disk, a quota: written into a temporary folder, so the last good one stands
        last = latest_step(run.run_dir)
        kept = f"the checkpoint of step {last} stays readable" if last else "no earlier checkpoint"
        raise CheckpointError(f"could not write the checkpoint of step {step} in {run.run_dir}/checkpoints: "
                              f"{e} ({kept})") from None


def for_ranks(cfg: TrainConfig, dist: Dist) -> TrainConfig:
    """The settings several ranks can run: full fine-tuning (weights gathered on rank 0 for each push), or a
    LoRA policy pushed as an adapter (merged weights would need the sharded base gathered on rank 0 each
    step, which is not built)."""
    if not dist.active or cfg.model.full_finetune:
        return cfg
    if cfg.model.sync == "merged":
        raise ValueError("model.sync: merged needs one trainer process (the base weights are sharded over ranks); "
                         "use adapter or auto")
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"sync": "adapter"})})


def group_metrics(groups: list[TrajectoryGroup], adv: GroupAdvantages) -> dict[str, float]:
    """The groups' figures: `reward_std`, the spread the estimator normalised (`GroupAdvantages.spread`); the share
    of groups without signal; trajectories kept and dropped."""
    return {"reward_std": adv.spread,
            "zero_variance_group_share": adv.num_zero_variance_groups / max(len(groups), 1),
            "kept_trajectories": float(len(adv.trajectories)),
            "dropped_trajectories": float(adv.num_dropped_trajectories)}
