"""Integration: real vLLM servers that a test starts and ends itself (one that cannot start, one killed mid-rollout),
apart from the session's servers (tests/test_integration_vllm.py), so that they start in the own lane (Makefile)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest
from helpers import until

from agent_rl.envs.calculator import CalculatorEnv, arithmetic_tasks
from agent_rl.rollout.engine import rollout_groups
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.rollout.serving.base import ServerError
from agent_rl.rollout.serving.vllm.sampler import VLLMSampler
from agent_rl.rollout.serving.vllm.server import VLLMServer

pytestmark = pytest.mark.integration


def test_server_that_does_not_start_quotes_its_log(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(ServerError, match="exited with status .* during start-up; log .* ends with: .+"):
        VLLMServer(tmp_path, startup_timeout_s=120).start()


def test_kill_mid_rollout_gives_infra_errors_and_stop_leaves_nothing(tiny_dir, renderer):
    """A server killed with 8 rollouts' requests in flight: every one is an ERROR trajectory, quickly. The server is
    frozen (SIGSTOP) before they are sent, so none can be answered before the kill, however fast it would answer
    (a kill after a fixed delay raced it)."""
    server = VLLMServer(tiny_dir, kv_cache_gib=1, max_model_len=1024).start()
    pgid = server.proc.pid
    tasks = arithmetic_tasks(4, seed=5)
    limits = EpisodeLimits(max_turns=1, max_tokens_per_turn=800, max_total_tokens=1000)

    async def run():
        async with VLLMSampler([server.url], retries=2, backoff_s=0.1, request_timeout_s=30) as sampler:
            os.killpg(pgid, signal.SIGSTOP)  # its listening socket still takes the connections
            job = asyncio.create_task(rollout_groups(tasks, CalculatorEnv, sampler, renderer, limits, 2))
            await until(lambda: sampler.in_flight(server.url) == 8, "8 requests in flight")
            await asyncio.sleep(0.2)  # their bytes written (one still being written fails the same way)
            os.killpg(pgid, signal.SIGKILL)  # the server dies with all of them in flight
            return await asyncio.wait_for(job, 60)

    try:
        t0 = time.monotonic()
        groups = asyncio.run(run())
        elapsed = time.monotonic() - t0
    finally:
        server.stop()
    trajs = [t for g in groups for t in g.trajectories]
    errors = [t for t in trajs if t.infra_error]
    assert len(errors) == 8, [t.stop_reason for t in trajs]
    assert all(server.url in t.error and "did not answer" in t.error for t in errors)
    assert elapsed < 30
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)  # no process of the server's group is left
