"""Opening a session: what every command needs from a config, built one way.

Owns: `Session` (the config, the model folder, its renderer and the environment: `rollout.env`, or the
weighted mixture of `rollout.envs` as one, `env_of`) from `open_session`; `sampling`: the run's vLLM
servers (started here or attached) with a sampler on them and where the episodes play, as one async context
(a `rollout.players.Served`: in this process, or with `rollout.workers` on that many Ray workers, `with_workers`;
what each plays with: `worker_kit`); `supervised_sampling`, the same with the servers watched and mended
(`rollout.supervisor`, what `train` uses; the workers route by it too); `episodes`, how every command plays a
group (`rollout.engine.Episodes`: the environment's group reward, the failure policy and the return's rule, as the
config says, for training, evaluation and `agent-rl rollout` alike); and `judging`: the session with the LLM judge
of `cfg.judge` added to its group rewards, on those servers or another.
`agent-rl train`, `eval`, `rollout`, `demos`, `sft` and `play` all open their run through these, so
a model spec, a renderer name or a server URL means the same everywhere.
Does not own: the model's weights (`learn.policy`), weight sync (`rollout.weight_sync`), metrics.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from agent_rl.config.train import TrainConfig
from agent_rl.core.config import JudgeConfig
from agent_rl.core.mixture import load_mixture
from agent_rl.core.registry import EnvSpec, load_env
from agent_rl.core.renderers.base import Renderer
from agent_rl.core.renderers.choose import load_renderer
from agent_rl.learn.models import resolve_model
from agent_rl.rewards.group import combine_group_rewards, judge_group_reward
from agent_rl.rewards.judge import DEFAULT_PROMPT, LLMJudge
from agent_rl.rollout.branching import BranchRule
from agent_rl.rollout.engine import Episodes
from agent_rl.rollout.players import LocalPlayers, Players, Served
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.rollout.sampler import ServedSampler
from agent_rl.rollout.serving.choose import serving_backend
from agent_rl.rollout.supervisor import Supervisor
from agent_rl.rollout.worker import Kit, WorkerSettings
from agent_rl.rollout.workers import ray_cluster, rollout_workers


@dataclass(frozen=True)
class Session:
    cfg: TrainConfig
    model_dir: Path
    renderer: Renderer
    env: EnvSpec


def env_of(cfg: TrainConfig) -> EnvSpec:
    """`rollout.env`, or the environments of `rollout.envs` as one (`core.mixture`)."""
    r = cfg.rollout
    if r.env is not None:
        return load_env(r.env).with_task_args(r.env_args)
    return load_mixture(r.mixture, [e.args for e in r.envs])


def open_session(cfg: TrainConfig) -> Session:
    """Resolve `model.name` and `rollout.env(s)` (with their `env_args` bound into `load_tasks`); a bad one
    raises ModelError / ValueError (one line)."""
    env = env_of(cfg)  # cheap, so it fails before the model is fetched or converted
    _judge_inputs(cfg.judge)
    model_dir = resolve_model(cfg.model.name)
    return Session(cfg, model_dir, load_renderer(model_dir, cfg.model.renderer, cfg.model.bare_tool_calls), env)


def _judge_inputs(judge: JudgeConfig) -> tuple[str, str | None]:
    """The judge's prompt template and API key, read where the config points; a missing one is one line."""
    prompt = DEFAULT_PROMPT
    if judge.prompt is not None:
        if not Path(judge.prompt).is_file():
            raise ValueError(f"judge.prompt: no file {judge.prompt!r}")
        prompt = Path(judge.prompt).read_text()
        if "{question}" not in prompt or "{answers}" not in prompt:
            raise ValueError(f"judge.prompt: {judge.prompt!r} lacks the {{question}} and {{answers}} placeholders")
    key = None
    if judge.api_key_env is not None:
        key = os.environ.get(judge.api_key_env)
        if not key:
            raise ValueError(f"judge.api_key_env: the environment variable {judge.api_key_env} is not set")
    return prompt, key


@contextlib.asynccontextmanager
async def judging(session: Session, urls: Sequence[str], run_dir: Path) -> AsyncIterator[Session]:
    """`session` with `cfg.judge`'s LLM judge added to its group rewards (`judge.url: run`: the first of
    `urls`, the run's own servers), writing its prompt and cache to `run_dir/judge`; as it is without one."""
    j = session.cfg.judge
    if j.url is None:
        yield session
        return
    prompt, key = _judge_inputs(j)
    url = urls[0] if j.url == "run" else j.url
    async with LLMJudge(url, j.model, prompt=prompt, out_dir=run_dir / "judge", reference=j.reference,
                        max_tokens=j.max_tokens, temperature=j.temperature, timeout_s=j.timeout_s,
                        api_key=key) as judge:
        hook = combine_group_rewards(session.env.group_reward, judge_group_reward(judge, j.weight))
        yield replace(session, env=replace(session.env, group_reward=hook))


@contextlib.asynccontextmanager
async def sampling(session: Session, log_path: Path | None = None) -> AsyncIterator[Served]:
    """A sampler over the run's servers (the serving backend's `serve`: started here, or attached by URL), closed on
    exit, and where the episodes play (`with_workers`; with `rollout.workers`, the cluster is joined before any
    server starts)."""
    cfg, backend = session.cfg, serving_backend()
    with ray_cluster(cfg.ray, cfg.rollout.workers), \
            backend.serve(cfg.model, cfg.sampler, cfg.run.seed, session.model_dir, log_path) as fleet:
        async with backend.sampler(fleet.urls, request_timeout_s=cfg.sampler.request_timeout_s) as sampler, \
                with_workers(session, fleet.urls, sampler) as served:
            yield served


@contextlib.asynccontextmanager
async def supervised_sampling(session: Session, log_path: Path | None = None
                              ) -> AsyncIterator[tuple[Served, Supervisor]]:
    """`sampling`, and a supervisor of its servers that the sampler routes by: one started here is restarted when
    it dies, one attached by URL waited for (`rollout.supervisor`; supervision begins at `Supervisor.start`).
    With `rollout.workers`, the cluster is joined before any server starts, and the sampler is bound to the
    supervisor before the workers wrap it, so that every worker routes by it too (`rollout.workers`). On exit the
    workers stop first, then the supervisor, so that no restart outlives the servers' own stop."""
    cfg, model_dir, backend = session.cfg, session.model_dir, serving_backend()
    with ray_cluster(cfg.ray, cfg.rollout.workers), \
            backend.serve(cfg.model, cfg.sampler, cfg.run.seed, model_dir, log_path) as fleet:
        async with backend.sampler(fleet.urls, request_timeout_s=cfg.sampler.request_timeout_s) as sampler, \
                Supervisor.from_config(cfg.sampler, fleet.urls, fleet.processes) as supervisor:
            supervisor.bind(sampler)
            async with with_workers(session, fleet.urls, sampler) as served:
                yield served, supervisor


def with_workers(session: Session, urls: Sequence[str], sampler: ServedSampler
                 ) -> contextlib.AbstractAsyncContextManager[Served]:
    """`sampler`, and where the episodes play: here, through it, with the session's environments and renderer; or
    with `rollout.workers`, on that many Ray workers (`rollout.workers`), which the sampler then tells of every
    change of the served policy."""
    cfg = session.cfg
    settings = WorkerSettings(cfg.ray, cfg.sampler.request_timeout_s)
    kit = functools.partial(worker_kit, cfg, tuple(urls))
    here = LocalPlayers(session.env.make_env, sampler, session.renderer, servers=len(urls))
    return rollout_workers(cfg.rollout.workers, kit, sampler, here, settings)


def episodes(session: Session, players: Players, limits: EpisodeLimits, group_size: int,
             training: bool = False) -> Episodes:
    """How every command plays a group: on `players`, with the environment's group reward, the config's failure
    policy (`rollout.on_error`, `max_retries`) and its return rule (`algorithm.truncated_reward`); in `training`,
    with the branches at the tool decision that `algorithm.tool_branches` asks for (`rollout.branching`)."""
    cfg = session.cfg
    return Episodes(players, limits, group_size, session.env.group_reward, cfg.rollout.on_error,
                    cfg.rollout.max_retries, cfg.algorithm.truncated_reward,
                    branch_rule(session) if training and cfg.algorithm.tool_branches > 0 else None)


def branch_rule(session: Session) -> BranchRule:
    """`algorithm.tool_branches`' rule, with the opening of a call as the session's renderer writes it and what
    `eval.success_threshold` counts as solved."""
    cfg, renderer = session.cfg, session.renderer
    return BranchRule(cfg.algorithm.tool_branches, tuple(renderer.call_opening()), cfg.algorithm.force_call,
                      cfg.eval.success_threshold, functools.lru_cache(maxsize=None)(lambda i: renderer.decode_raw([i])))


def worker_kit(cfg: TrainConfig, urls: Sequence[str]) -> Kit:
    """What a rollout worker plays with, built in its own process: the run's environments (or mixture), the
    renderer of `model.name` and a sampler over `urls` (each machine of a cluster resolves the model itself)."""
    renderer = load_renderer(resolve_model(cfg.model.name), cfg.model.renderer, cfg.model.bare_tool_calls)
    sampler = serving_backend().sampler(urls, request_timeout_s=cfg.sampler.request_timeout_s)
    return Kit(env_of(cfg).make_env, renderer, sampler)
