"""Rollout workers on Ray (`rollout.workers`, `rollout.ray_pool`) in the real loop and stream, with a seeded
sampler built inside each worker (tests/ray_kits.py) on one local Ray cluster for the session (`ray_local`): the
same seeds give the same trajectories, traces and counts with 0 and 2 workers (dynamic sampling, a group reward,
a mixture of environments); the staleness bound holds with episodes in flight on both workers; a worker killed
mid-rollout costs retries, not data, and the next step plays on its restart; and the failures of start-up
(Ray missing, a cluster that does not answer, workers that cannot start or build their kit, every worker dead)
are one line each."""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import helpers
import pytest

from agent_rl.config.file import load_config
from agent_rl.core.config import ConfigError, RayConfig
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.rollout.worker import WorkerError, WorkerSettings
from agent_rl.rollout.workers import rollout_workers
from agent_rl.runs import traces
from agent_rl.session import env_of

ROOT = Path(__file__).resolve().parents[1]


def rank_bonus(task, trajectories):
    """A group reward: +0.25 for the shortest reply of the group (ties: each), scored on rank 0."""
    lengths = [len(t.token_ids) for t in trajectories]
    return [0.25 if n == min(lengths) else 0.0 for n in lengths]


async def run_on(workers: int, tmp_path, smol_dir, renderer, sets, kit_args=(), stages_update=None):
    """The loop on 24 tasks of the run's environment(s); `workers` Ray workers play the episodes (0: here)."""
    cfg = load_config(None, list(sets))
    run = helpers.scripted_run(tmp_path, smol_dir, renderer, env_of(cfg).load_tasks(24, seed=3, split="train"), *sets)
    run.session = replace(run.session, env=replace(run.session.env, group_reward=rank_bonus))
    import ray_kits

    kit = functools.partial(ray_kits.seeded_kit, run.cfg, str(smol_dir), *kit_args)
    local = ray_kits.SeededSampler(renderer)
    async with rollout_workers(workers, kit, local, helpers.here(run, local), WorkerSettings()) as served:
        seen, lines = await helpers.run_loop(run, served.sampler, players=served.players)
        stats = served.sampler.stats() if workers else {}
    return seen, lines, stats


COUNTS = ("resample_batches", "error/retried", "error/dropped_groups", "reward_mean", "kept_trajectories",
          "data_position")


@pytest.mark.parametrize("sets", [
    ("rollout.env=half_flat_env", "algorithm.dynamic_sampling=true", "algorithm.max_resample_batches=1"),
    ("rollout.envs={toy: 1, half_flat_env: 1}",),
], ids=["dynamic-sampling", "mixture"])
async def test_the_same_seeds_give_the_same_trajectories_with_0_and_2_workers(
        sets, tmp_path, smol_dir, renderer, ray_local):
    sets = (*sets, "run.steps=4", "run.trace_groups=2")
    here, lines_here, _ = await run_on(0, tmp_path / "here", smol_dir, renderer, sets)
    there, lines_there, stats = await run_on(2, tmp_path / "there", smol_dir, renderer, sets)
    assert helpers.essence(there) == helpers.essence(here)
    assert [{k: x.get(k) for k in COUNTS} for x in lines_there] == [{k: x.get(k) for k in COUNTS} for x in lines_here]
    assert traces.read_traces(tmp_path / "there") == traces.read_traces(tmp_path / "here")
    # both workers played, and between them every episode of the run
    played = sum(len(g.trajectories) for step in here for g in step)
    assert len(stats) == 2 and all(s["episodes"] > 0 for s in stats.values())
    assert sum(s["episodes"] for s in stats.values()) >= played
    if "algorithm.dynamic_sampling=true" in sets:
        assert sum(x["resample_batches"] for x in lines_here) >= 1  # refills happened, on both sides alike
    else:
        assert {t.env for step in here for g in step for t in g.trajectories} == {"toy", "half_flat_env"}


async def test_the_staleness_bound_counts_the_episodes_on_every_worker(tmp_path, smol_dir, renderer, ray_local):
    """k = 2, requests of 50 ms: the stream runs ahead of the trainer on both workers, and no trained token is more
    than 2 versions behind the step that trains it; every task of 8 steps x 3 slots is trained once."""
    sets = ("rollout.env=toy", "run.steps=8", "algorithm.max_staleness=2")
    seen, lines, stats = await run_on(2, tmp_path, smol_dir, renderer, sets, kit_args=(0.05,))
    lags = [step - v for step, groups in enumerate(seen) for g in groups for t in g.trajectories
            for v, m in zip(t.versions, t.loss_mask) if m]
    assert max(lags) <= 2 and max(lags) >= 1
    assert max(x["push/episodes_in_flight"] for x in lines) >= 1  # pushes came with episodes in flight on workers
    trained = [g.task_id for groups in seen for g in groups]
    assert len(trained) == 24 == len(set(trained))
    assert all(s["episodes"] > 0 for s in stats.values())


async def test_a_worker_killed_mid_rollout_costs_retries_and_the_next_step_plays_on_its_restart(
        tmp_path, smol_dir, renderer, ray_local):
    """The worker that plays the first request about trees (task 1 of step 0) SIGKILLs itself, its other episodes
    in flight with it. They come back as infrastructure errors (`WorkerDied`), `rollout.on_error: retry` plays
    them again with their own seeds on the worker that is up, and the steps train exactly what a run with no
    fault and no workers trains. Step 0's update waits until Ray has restarted the worker: step 1 plays on it."""
    sets = ("rollout.env=toy", "run.steps=3")
    marker = tmp_path / "killed.pid"
    here, _, _ = await run_on(0, tmp_path / "here", smol_dir, renderer, sets)

    cfg = load_config(None, list(sets))
    run = helpers.scripted_run(tmp_path / "there", smol_dir, renderer, env_of(cfg).load_tasks(24, seed=3), *sets)
    run.session = replace(run.session, env=replace(run.session.env, group_reward=rank_bonus))
    import ray_kits

    kit = functools.partial(ray_kits.seeded_kit, run.cfg, str(smol_dir), 0.05, "trees", str(marker))
    local = ray_kits.SeededSampler(renderer)
    async with rollout_workers(2, kit, local, helpers.here(run, local), WorkerSettings()) as served:
        sampler = served.sampler
        pids = {w.index: w.pid for w in sampler.pool.workers}
        waited = []

        def wait_for_the_restart():  # called in the update's thread: the stream is idle meanwhile (k = 0)
            helpers.until_sync(lambda: all(w.up for w in sampler.pool.workers), "the killed worker back", 60,
                               every_s=0.05)
            waited.append(True)

        seen, lines = await helpers.run_loop(run, served.sampler, players=served.players, train_s=0,
                                             after_update=wait_for_the_restart)
        after = sampler.stats()
    killed = int(marker.read_text())
    index = next(i for i, pid in pids.items() if pid == killed)
    assert helpers.essence(seen) == helpers.essence(here)  # what an unfaulted run trains, token for token
    assert lines[0]["error/WorkerDied"] >= 1 and lines[0]["error/retried"] == lines[0]["error/WorkerDied"]
    assert lines[0]["error/dropped_groups"] == 0 and waited
    assert after[index]["pid"] != killed and after[index]["episodes"] > 0  # restarted, and played steps 1-2
    assert all("error/WorkerDied" not in x for x in lines[1:])


def elsewhere(renderer):
    """A scripted sampler here, and players that must never play here (the workers do)."""
    import ray_kits

    sampler = ray_kits.SeededSampler(renderer)
    return sampler, helpers.not_here(sampler, renderer)


def test_ray_missing_is_one_line():
    """`rollout.workers` without Ray installed (hidden here): one line naming the extra, exit status 2, before any
    server starts."""
    code = ("import sys; sys.modules['ray'] = None\n"
            "from agent_rl.cli import main\n"
            "sys.argv = ['agent-rl', 'rollout', '--env', 'toy', '--workers', '2', '--server-url', 'http://127.0.0.1:9']\n"
            "sys.exit(main())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "error: config error: rollout.workers: 2 workers run on Ray, which is not installed: "
        "pip install 'agent-rl[ray]'")
    assert "Traceback" not in out.stderr


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_cluster_that_does_not_answer_is_one_line():
    """RAY_ADDRESS pointing at nothing: one line within seconds (Ray's own client retries for minutes)."""
    port = _closed_port()
    code = ("import sys\nfrom agent_rl.cli import main\n"
            "sys.argv = ['agent-rl', 'rollout', '--env', 'toy', '--workers', '2', '--server-url', 'http://127.0.0.1:9']\n"
            "sys.exit(main())")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": f"127.0.0.1:{port}"})
    assert out.returncode == 2 and time.monotonic() - t0 < 60
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: config error: RAY_ADDRESS: no Ray cluster answers at 127.0.0.1:{port} (")
    assert last.endswith("); start its head (ray start --head) or fix the address") and "Traceback" not in out.stderr


def test_a_cluster_of_this_machine_has_room_for_the_workers_and_leaves_sigterm_alone():
    """No address: `connected` starts a cluster of this machine with at least the workers' CPUs (8 x 1 on 2 cores)
    and the custom resources they ask (8 x docker: 1), keeps the process's own SIGTERM handler (ray.init would
    make SIGTERM exit at once), and shuts the cluster down after."""
    code = ("import signal, ray\n"
            "from agent_rl.core.config import RayConfig\n"
            "from agent_rl.rollout.ray_connect import connected\n"
            "def mine(signum, frame): pass\n"
            "signal.signal(signal.SIGTERM, mine)\n"
            "with connected(RayConfig(resources={'docker': 1}), 8):\n"
            "    total = ray.cluster_resources()\n"
            "    print(total['CPU'] >= 8, total['docker'], signal.getsignal(signal.SIGTERM) is mine)\n"
            "print(ray.is_initialized())\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                         env={**env, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "8.0", "True", "False"]


def test_ray_address_names_the_field_and_takes_ray_client_addresses():
    from agent_rl.rollout.ray_connect import answers

    port = _closed_port()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}", "no-port-here"):
        with pytest.raises(ConfigError, match=r"^config error: ray\.address: no Ray cluster answers at "):
            answers("ray.address", address)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        answers("ray.address", f"ray://127.0.0.1:{listening.getsockname()[1]}")  # something answers: no error


async def test_workers_that_no_node_can_hold_are_one_line(ray_local, smol_dir, renderer):
    import ray_kits

    kit = functools.partial(ray_kits.seeded_kit, load_config(None, []), str(smol_dir))
    settings = WorkerSettings(RayConfig(resources={"docker": 1}, start_timeout_s=3))
    with pytest.raises(WorkerError) as e:
        async with rollout_workers(2, kit, *elsewhere(renderer), settings):
            pass
    assert str(e.value) == ("2 rollout workers did not all start within 3 s (ray.start_timeout_s): does a node of "
                            "the cluster have what each asks, {'CPU': 1.0, 'docker': 1.0}? (`ray status` lists "
                            "what the nodes have)")


async def test_a_worker_that_cannot_build_its_kit_is_one_line(ray_local, smol_dir, renderer):
    import ray_kits

    kit = functools.partial(ray_kits.seeded_kit, load_config(None, ["rollout.env=no_such_env_here"]), str(smol_dir))
    with pytest.raises(WorkerError, match=r"^rollout worker 0 cannot play: ValueError: unknown environment "
                                          r"'no_such_env_here' \(built-in: "):
        async with rollout_workers(2, kit, *elsewhere(renderer), WorkerSettings()):
            pass


async def test_every_worker_dead_for_good_ends_the_run_with_one_line(ray_local, smol_dir, renderer):
    import ray_kits

    kit = functools.partial(ray_kits.seeded_kit, load_config(None, ["rollout.env=toy"]), str(smol_dir))
    settings = WorkerSettings(RayConfig(max_restarts=0))
    limits = EpisodeLimits(max_turns=1, seed=0)
    async with rollout_workers(2, kit, *elsewhere(renderer), settings) as served:
        for w in served.sampler.pool.workers:
            os.kill(w.pid, 9)
        first = await served.players.play({"id": "t", "topic": "cats"}, 0, limits)
        assert first.infra_error and first.error.startswith("WorkerDied: rollout worker ")
        with pytest.raises(WorkerError, match=r"^every rollout worker has died for good \(ray.max_restarts: 0\)"):
            for _ in range(4):  # the other one's death is found by the next episode sent to it
                await asyncio.wait_for(served.players.play({"id": "t", "topic": "cats"}, 1, limits), 60)


def test_the_config_takes_workers_and_the_ray_section():
    cfg = load_config(None, ["rollout.workers=4", "ray.address=auto", "ray.num_cpus=0.5", "ray.resources={docker: 1}",
                             "ray.max_restarts=-1"])
    assert (cfg.rollout.workers, cfg.ray.address, cfg.ray.num_cpus, cfg.ray.resources, cfg.ray.max_restarts) == \
        (4, "auto", 0.5, {"docker": 1.0}, -1)
    assert load_config(None, []).rollout.workers == 0
    with pytest.raises(ConfigError, match=r"^config error: rollout\.workers: "):
        load_config(None, ["rollout.workers=-1"])
