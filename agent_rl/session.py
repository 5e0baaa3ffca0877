"""Opening a session: what every command needs from a config, built one way.

Owns: `Session` (the config, the model folder, its renderer and the environment) from
`open_session`, and `sampling`: the run's vLLM servers (started here or attached) with a sampler on
them, as one async context. `agent-rl train`, `eval`, `rollout`, `demos`, `sft` and `play` all open
their run through these, so a model spec, a renderer name or a server URL means the same everywhere.
Does not own: the model's weights (`learn.policy`), weight sync (`rollout.weight_sync`), metrics.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from agent_rl.core.registry import EnvSpec, load_env
from agent_rl.core.renderer import Renderer
from agent_rl.core.renderers import load_renderer
from agent_rl.learn.models import resolve_model
from agent_rl.rollout.sampler import VLLMSampler
from agent_rl.rollout.server import serve_or_attach


@dataclass(frozen=True)
class Session:
    cfg: Any  # core.config.TrainConfig
    model_dir: Path
    renderer: Renderer
    env: EnvSpec


def open_session(cfg: Any) -> Session:
    """Resolve `model.name` and `rollout.env` (with `rollout.env_args` bound into its `load_tasks`); a bad
    one raises ModelError / ValueError (one line)."""
    # cheap, so it fails before the model is fetched or converted
    env = load_env(cfg.rollout.env).with_task_args(cfg.rollout.env_args)
    model_dir = resolve_model(cfg.model.name)
    return Session(cfg, model_dir, load_renderer(model_dir), env)


@contextlib.asynccontextmanager
async def sampling(cfg: Any, model_dir: str | Path, log_path: Path | None = None) -> AsyncIterator[VLLMSampler]:
    """A sampler over the run's servers (`rollout.server.serve_or_attach`), closed on exit."""
    with serve_or_attach(cfg, model_dir, log_path) as urls:
        async with VLLMSampler(urls, request_timeout_s=cfg.sampler.request_timeout_s) as sampler:
            yield sampler
