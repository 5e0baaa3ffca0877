"""A real `agent-rl train` (a process of its own, the tiny model, its own vLLM server): a SIGTERM ends it with a
checkpoint, 143 and one line, its server stopped. Its server SIGKILLed mid-run (restarted, the run as one nobody
touched, no orphan of either server), past the restart budget, and an attached server that does not come back:
tests/test_restarts_integration.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, process group) of `pid`, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[2])


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _train_until_step_1(run_dir: Path, tiny_dir: Path) -> tuple[subprocess.Popen, int]:
    """`agent-rl train` of 1,000 steps (more than any machine plays before the test signals it: with 4, a fast
    machine could end the run first), returned once step 1 is logged, with the pid of its server."""
    sets = [f"model.name={tiny_dir}", "model.lora_rank=4", "model.sync=merged", "sampler.kv_cache_gib=1",
            "sampler.max_model_len=2048", "rollout.env=toy", "rollout.tasks_per_step=2", "rollout.group_size=2",
            "rollout.max_turns=1", "rollout.max_tokens_per_turn=16", "rollout.max_total_tokens=128", "run.steps=1000",
            "run.save_every=1000", f"run.run_dir={run_dir}", "run.tensorboard=false"]
    proc = subprocess.Popen([sys.executable, "-m", "agent_rl.cli", "train", "--no-plot",
                             *[x for s in sets for x in ("--set", s)]], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().strip()):  # step 1 done: step 2 under way
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the run ended before step 1: {proc.communicate()[1]}")
        time.sleep(0.01)
    servers = [p for p in _pids() if (s := _stat(p)) is not None and s[0] == proc.pid]
    assert len(servers) == 1, f"expected the run's one server among its children, got {servers}"
    return proc, servers[0]


def _left_of(group: int, within_s: float = 1.0) -> list[int]:
    """Processes still in `group` once `within_s` has passed for them to end, the wait over as soon as none is left
    (killed, so that a failure leaves nothing behind)."""
    deadline = time.monotonic() + within_s
    while (left := [p for p in _pids() if (s := _stat(p)) is not None and s[1] == group]) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    for p in left:
        os.kill(p, signal.SIGKILL)
    return left


def test_a_sigterm_checkpoints_the_last_step_and_stops_the_server(tmp_path, tiny_dir):
    run_dir = tmp_path / "run"
    proc, server = _train_until_step_1(run_dir, tiny_dir)
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: preempted by SIGTERM after step (\d+) of 1000 \(checkpoint of step \1 in "
                        rf"{re.escape(str(run_dir))}/checkpoints\); continue with the same command and --resume",
                        last), err
    assert "Traceback" not in err and "never retrieved" not in err
    assert (run_dir / "checkpoints" / "latest").is_file()
    assert _left_of(server) == [], "the run's server outlived it"
