"""Servers that die during `agent-rl train` (a real process, tests/restart_worker.py: the command as it is, its
server SIGKILLed while a step's requests are in flight), the tiny model on a real vLLM server:

- killed in the middle of step 2 of 3: the supervisor restarts it on its port with the current adapter, the
  episodes that were in flight are replayed with their own seeds, and the run ends as a run nobody touched; nothing
  of the killed server (its engine processes outlive their leader) nor of the restarted one outlives the run. With
  the episodes on Ray workers the same is tested against stand-in servers (tests/test_workers_restarts.py): each
  real server start costs 30-70 s, and CI has 40 minutes for everything;
- killed past `sampler.max_restarts` (0 here; counting restarts is tests/test_supervisor.py's): one line, a
  checkpoint, exit status 1, nothing of the server left;
- a server attached by URL that does not come back within `sampler.attach_wait_s`: the same kind of line.

The tolerance of "ends as a run nobody touched" is none: the trained tokens, step 2's figures that read the
served log-probs, and the final adapter are compared exactly (torch.equal). Why that holds, measured on this
build (docs/reliability.md): vLLM's CPU build in float32 samples each request from its own seeded generator,
and for this tiny model a request's log-probs do not depend on which other requests share its batch (a replayed
episode runs beside other requests than the first time), so a replay draws the same tokens with bit-identical
log-probs, and the trainer then does the same float operations in the same order. (SmolLM2-135M is not
batch-invariant here: its replays keep the tokens but move log-probs by up to 2.6e-5, so a test on it would need
a tolerance.) Why none rather than a small one: a restart that served the previous version (v0 instead of v1,
one Adam step of 1e-4 apart) would mostly sample the same tokens from nearly the same distribution; only the
log-probs would show it (`logprob_gap_mean`, and the adapter through the importance weights, far below any
tolerance one would pick for noise). A different token, the other failure that matters, moves the adapter by
about the learning rate (1e-4) per weight: Adam's first steps are near sign(gradient) x lr.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

# each run starts its own vLLM server (30-70 s here under load), and a restart starts one more
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

WORKER = [sys.executable, str(Path(__file__).with_name("restart_worker.py"))]


def _train(run_dir: Path, tiny_dir: Path, kills: str = "", *sets: str, env: dict | None = None
           ) -> subprocess.CompletedProcess:
    """`agent-rl train` of 3 steps (2 tasks x 4 rollouts, traces of every group), the server killed at `kills`.
    Merged weights, as `model.sync: auto` picks for this model on a server the run starts, named so that no run
    spends ~20 s on auto's burst (tests/test_weight_sync.py tests the choice)."""
    base = [f"model.name={tiny_dir}", "model.lora_rank=4", "model.sync=merged", "sampler.kv_cache_gib=1",
            "sampler.max_model_len=2048", "rollout.env=toy", "rollout.tasks_per_step=2", "rollout.group_size=4",
            "rollout.max_turns=1", "rollout.max_tokens_per_turn=64", "rollout.max_total_tokens=256", "run.steps=3",
            "run.save_every=1", f"run.run_dir={run_dir}", "run.tensorboard=false", "run.trace_groups=2"]
    return subprocess.run([*WORKER, kills, "train", "--no-plot", *[x for s in [*base, *sets] for x in ("--set", s)]],
                          capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})})


def _trained_tokens(run_dir: Path) -> list[list[list[int]]]:
    """Every traced trajectory's token ids (all groups are traced), step by step."""
    return [[seg["token_ids"] for line in path.read_text().splitlines() for seg in json.loads(line)["segments"]]
            for path in sorted((run_dir / "traces").glob("*.jsonl"))]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _in(groups: list[int]) -> list[int]:
    """The live processes (zombies left out) in any of `groups`."""
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(stat[2]) in groups and stat[0] != "Z":
            found.append(int(p))
    return found


def _left_in(groups: list[int], within_s: float = 1.0) -> list[int]:
    """Processes still in any of `groups` once `within_s` has passed for them to end, the wait over as soon as
    none is left (killed, so that a failure leaves nothing behind)."""
    deadline = time.monotonic() + within_s
    while (left := _in(groups)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in left:
        os.kill(p, signal.SIGKILL)
    return left


def _killed(run_dir: Path) -> list[int]:
    return [int(x) for x in (run_dir / "killed.txt").read_text().split()]


def _servers(run_dir: Path) -> list[int]:
    """The process groups of the run's servers as its steps began sampling (restart_worker.py)."""
    return [int(x) for x in (run_dir / "servers.txt").read_text().split()]


@pytest.fixture(scope="module")
def untouched(tmp_path_factory, tiny_dir) -> Path:
    """The 3-step run nobody touches, in one process: what each killed run must end as."""
    run_dir = tmp_path_factory.mktemp("untouched")
    done = _train(run_dir, tiny_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def test_a_server_killed_in_step_2_comes_back_and_the_run_ends_as_one_nobody_touched(tmp_path, tiny_dir, untouched):
    killed = tmp_path / "killed"
    done = _train(killed, tiny_dir, "1")  # step 2 samples under version 1
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert re.search(r"WARNING vLLM server http://127\.0\.0\.1:\d+ exited with status -9: restarting it \(restart 1 "
                     r"of at most 3, sampler\.max_restarts\)", done.stderr), done.stderr[-3000:]
    step2 = _metrics(killed)[1]
    assert step2["fault/restarts"] == 1 and step2["fault/down_s"] > 0, (step2, done.stderr[-3000:])
    assert step2["fault/replayed_episodes"] >= 1, step2  # the kill found requests in flight
    assert not any(k.startswith("error/") and k not in ("error/retried", "error/dropped_groups") for k in step2)
    assert step2["error/retried"] == 0 and step2["infra_error_rate"] == 0  # no retry budget spent, no failure
    for figure in ("data_position", "reward_mean", "logprob_gap_mean", "entropy", "loss", "grad_norm"):
        assert [m[figure] for m in _metrics(killed)] == [m[figure] for m in _metrics(untouched)], figure

    assert _trained_tokens(killed) == _trained_tokens(untouched)  # every trajectory of every step
    ours, theirs = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (killed, untouched))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert len(_killed(killed)) == 1 and _left_in(_killed(killed)) == []  # the engine it left behind was stopped
    restarted = sorted(set(_servers(killed)) - set(_killed(killed)))
    assert len(restarted) == 1 and _left_in(restarted) == [], "the restarted server outlived the run"


def test_past_its_restart_budget_the_run_checkpoints_and_stops_with_one_line(tmp_path, tiny_dir):
    run_dir = tmp_path / "run"
    done = _train(run_dir, tiny_dir, "1", "sampler.max_restarts=0", "run.save_every=10")  # killed in step 2
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: vLLM server http://127\.0\.0\.1:\d+ exited with status -9; restarted 0 time\(s\) "
                        rf"already \(sampler\.max_restarts: 0\) \(checkpoint of step 1 in {re.escape(str(run_dir))}"
                        rf"/checkpoints; continue with the same command and --resume once the servers answer\)",
                        last), done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "never retrieved" not in done.stderr
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-000001"  # written at the stop
    assert len(_metrics(run_dir)) == 1, done.stderr[-3000:]  # step 2 was abandoned while it sampled
    groups = _killed(run_dir)
    assert len(groups) == 1 and _left_in(groups) == [], "the run's server outlived it"


def test_an_attached_server_that_does_not_come_back_ends_the_run_with_one_line(tmp_path, tiny_dir):
    from agent_rl.rollout.serving.vllm.server import VLLMServer

    run_dir = tmp_path / "run"
    with VLLMServer(tiny_dir, kv_cache_gib=1, max_model_len=2048) as server:
        done = _train(run_dir, tiny_dir, "1", f"sampler.server_urls=[{server.url}]", "sampler.attach_wait_s=3",
                      "model.sync=adapter",  # what auto picks on a server that cannot reload weights
                      env={"AGENT_RL_TEST_KILL_PID": str(server.proc.pid)})
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last == (f"error: vLLM server {server.url} stopped answering and did not answer again within 3 s "
                    f"(sampler.attach_wait_s) (checkpoint of step 1 in {run_dir}/checkpoints; continue with the same "
                    f"command and --resume once the servers answer)"), done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-000001"
