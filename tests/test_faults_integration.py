"""A run's own vLLM server SIGKILLed in the middle of a real `agent-rl train` (a process of its own, the tiny
model): the run ends with one line naming the checkpoint to go on from, exit status 1, no traceback, and
nothing of the server's process group left behind."""

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


def test_the_runs_server_killed_mid_run_ends_it_with_one_line_and_no_orphan(tmp_path, tiny_dir):
    run_dir = tmp_path / "run"
    sets = [f"model.name={tiny_dir}", "model.lora_rank=4", "sampler.kv_cache_gib=1", "sampler.max_model_len=2048",
            "rollout.env=toy", "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_turns=1",
            "rollout.max_tokens_per_turn=16", "rollout.max_total_tokens=128", "run.steps=4", "run.save_every=1",
            f"run.run_dir={run_dir}", "run.tensorboard=false"]
    proc = subprocess.Popen([sys.executable, "-m", "agent_rl.cli", "train", "--no-plot",
                             *[x for s in sets for x in ("--set", s)]], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().strip()):  # step 1 done: step 2 under way
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before step 1"
            time.sleep(0.01)
        servers = [p for p in _pids() if (s := _stat(p)) is not None and s[0] == proc.pid]
        assert len(servers) == 1, f"expected the run's one server among its children, got {servers}"
        server = servers[0]
        os.kill(server, signal.SIGKILL)  # the server's own process, as an OOM kill would: its children stay
        _, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: .*\(checkpoint of step [1-3] in {re.escape(str(run_dir))}/checkpoints; continue "
                        r"with the same command and --resume once the servers answer\)", last), err
    assert "Traceback" not in err and "never retrieved" not in err
    time.sleep(1)
    left = [p for p in _pids() if (s := _stat(p)) is not None and s[1] == server]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert left == [], "processes of the killed server's group outlived the run"
