"""What the rollout workers of the tests play with: kits (`rollout.workers.Kit`) built inside each Ray worker's
process, so they live in a module the workers can import (the `ray_local` fixture puts tests/ on their path).

Owns: `SeededSampler` (replies "a" x (1 + seed mod 29) after a delay, tagged with the version served now: the
same seeds give the same tokens in any process), `seeded_kit` (the run's environments by its config, the
SmolLM2 renderer, a seeded sampler; it can kill its own worker once, on a task's first request), `served_kit`
(a real `VLLMSampler` over given servers, as `session.worker_kit` builds it, for the stand-in server's tests).
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from agent_rl.config.train import TrainConfig
from agent_rl.core.registry import load_env
from agent_rl.core.renderers.choose import load_renderer
from agent_rl.rollout.sampler import Completion
from agent_rl.rollout.serving.choose import serving_backend
from agent_rl.rollout.worker import Kit
from agent_rl.session import env_of


class SeededSampler:
    """Replies "a" x (1 + seed mod 29) after `delay_s`, with the version served now. `die_on`: the worker
    process playing a request whose prompt holds this text kills itself (SIGKILL), once: the first to do so
    leaves `marker`, and later requests (a retry, a restarted worker) find it."""

    def __init__(self, renderer, delay_s: float = 0.01, die_on: str | None = None, marker: str | None = None):
        self.renderer, self.delay_s, self.die_on, self.marker = renderer, delay_s, die_on, marker
        self.policy_version = 0

    async def sample(self, prompt_ids, params, messages=()):
        if self.die_on is not None and self.die_on in self.renderer.render_text(prompt_ids):
            marker = Path(str(self.marker))
            if not marker.exists():
                marker.write_text(str(os.getpid()))
                await asyncio.sleep(0.2)  # the worker's other episodes are in flight now
                os.kill(os.getpid(), signal.SIGKILL)
        version = self.policy_version
        await asyncio.sleep(self.delay_s)
        ids = [*self.renderer.encode_reply("a" * (1 + params.seed % 29)), self.renderer.stop_token_ids[0]]
        return Completion(tuple(ids), (-0.5,) * len(ids), "stop", version)


def seeded_kit(cfg: TrainConfig, model_dir: str, delay_s: float = 0.01, die_on: str | None = None,
               marker: str | None = None) -> Kit:
    renderer = load_renderer(model_dir)
    return Kit(env_of(cfg).make_env, renderer, SeededSampler(renderer, delay_s, die_on, marker))


def served_kit(urls: tuple[str, ...], model_dir: str, env: str = "toy") -> Kit:
    return Kit(load_env(env).make_env, load_renderer(model_dir), serving_backend().sampler(list(urls)))
