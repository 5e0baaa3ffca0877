"""Rollout workers against a real vLLM server (the tiny model): the same seeds give the same tokens with 0 and 2
workers, and GRPO steps whose episodes play on 2 Ray workers (each with its own `VLLMSampler`, following every
adapter push), killed after step 2 and resumed, end where a straight run in one process ends."""

from __future__ import annotations

import asyncio
import functools
import json

import pytest
from helpers import killed_after_step_2, server_config
from safetensors.torch import load_file

from agent_rl import trainer
from agent_rl.core.registry import load_env
from agent_rl.rollout.engine import Episodes, play_groups
from agent_rl.rollout.players import LocalPlayers
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.rollout.serving.choose import serving_backend
from agent_rl.rollout.workers import rollout_workers
from agent_rl.runs import traces

pytestmark = pytest.mark.integration


async def test_the_same_seeds_give_the_same_tokens_with_0_and_2_workers(vllm_server, renderer, ray_local):
    import ray_kits

    env = load_env("toy")
    tasks = env.load_tasks(4, seed=1)
    limits = EpisodeLimits(max_turns=1, max_tokens_per_turn=32, max_total_tokens=256, seed=5)
    kit = functools.partial(ray_kits.served_kit, (vllm_server.url,), str(vllm_server.model_dir))
    played = {}
    for workers in (0, 2):
        async with serving_backend().sampler([vllm_server.url]) as local, \
                rollout_workers(workers, kit, local, LocalPlayers(env.make_env, local, renderer)) as served:
            played[workers] = await play_groups(tasks, Episodes(served.players, limits, group_size=4))
    here, there = ([t for g in played[w] for t in g.trajectories] for w in (0, 2))
    assert all(t.error is None for t in here + there) and len(there) == 16
    assert [t.token_ids for t in there] == [t.token_ids for t in here]
    assert [t.loss_mask for t in there] == [t.loss_mask for t in here]
    assert max(abs(a - b) for x, y in zip(here, there) for a, b in zip(x.logprobs, y.logprobs)) < 1e-4
    def rest(t):  # everything but the log-probs (compared above) and the seconds the reward took
        return (t.task_id, t.prompt_len, t.turns, t.messages, t.stop_reason, t.reward, t.reward_parts, t.versions)

    assert [rest(t) for t in there] == [rest(t) for t in here]
    assert len({t.token_ids for t in here}) > 4  # the seeds differ per rollout: not one reply copied


def test_grpo_on_2_workers_killed_and_resumed_ends_as_a_straight_run_in_one_process(
        tmp_path, vllm_server, monkeypatch, ray_local):
    """4 steps in one process; the same run with `rollout.workers: 2`, stopped after its step-2 checkpoint (2 GRPO
    steps whose episodes played on the workers) and resumed on 2 new workers: the same rewards at every step, the
    same traced episodes, the same adapter (within 1e-5, as tests/test_train_integration.py's resume test)."""
    straight = tmp_path / "straight"
    asyncio.run(trainer.train(server_config(vllm_server, straight, steps=4, **{"run.trace_groups": "2"})))
    killed = tmp_path / "killed"
    on_workers = {"rollout.workers": "2", "run.trace_groups": "2"}
    killed_after_step_2(monkeypatch, server_config(vllm_server, killed, steps=4, **on_workers))
    assert traces.read_traces(killed).keys() == {1, 2}
    asyncio.run(trainer.train(server_config(vllm_server, killed, steps=4, **on_workers), resume=True))

    def lines(run_dir):
        return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]

    for key in ("reward_mean", "kept_trajectories", "sampled_tokens_mean"):
        assert [x[key] for x in lines(killed)] == [x[key] for x in lines(straight)], key
    assert len(lines(straight)) == 4

    def traced(run_dir):
        return {s: [(r["task_id"], r["group"], r["index"], r["reward"]) for r in records]
                for s, records in traces.read_traces(run_dir).items()}

    assert traced(killed) == traced(straight) and sorted(traced(straight)) == [1, 2, 3, 4]
    a = load_file(str(straight / "adapters" / "v4" / "adapter_model.safetensors"))
    b = load_file(str(killed / "adapters" / "v4" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_agent_rl_rollout_on_2_workers_of_a_cluster_it_starts(vllm_server):
    """`agent-rl rollout --workers 2` in a process of its own: a cluster of this machine starts, two workers play
    the episodes against the server, the trajectories print, and the cluster is gone after."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-m", "agent_rl.cli", "rollout", "--env", "toy", "--model",
                          str(vllm_server.model_dir), "--server-url", vllm_server.url, "--tasks", "2",
                          "--group-size", "2", "--max-tokens", "16", "--workers", "2"],
                         capture_output=True, text=True, timeout=300, env={**env, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("#1/2") == 2 and out.stdout.count("#2/2") == 2  # 2 tasks x 2 rollouts printed
    assert "infra_error_rate" in out.stdout
