"""Preemption (`agent_rl.stopping`, `trainer.stop`): SIGTERM or SIGUSR1 during a run (a real process,
tests/preempt_worker.py) ends it with one line and 128 + the signal number, a checkpoint of the last completed
step, and `--resume` ends with the weights of a run nobody stopped, exactly (torch.equal: the same float
operations in the same order). A server that dies (a stand-in process, SIGKILLed) ends the run at the next
push with one line and exit status 1, after a checkpoint of the step just trained; `--resume` ends as well."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TimedSampler, run_loop, scripted_run, toy_tasks, until_sync

from agent_rl.stopping import Preempted

WORKER = [sys.executable, str(Path(__file__).with_name("preempt_worker.py"))]


def test_the_line_names_the_signal_the_step_and_how_to_go_on():
    e = Preempted("SIGUSR1", 2, 4, Path("runs/x"), checkpoint=True)
    assert e.code == 138  # 128 + 10
    assert str(e) == ("preempted by SIGUSR1 after step 2 of 4 (checkpoint of step 2 in runs/x/checkpoints); "
                      "continue with the same command and --resume")
    assert Preempted("SIGTERM", 0, 4, Path("r"), checkpoint=False).code == 143
    assert "no step completed, nothing saved" in str(Preempted("SIGTERM", 0, 4, Path("r"), checkpoint=False))


def _wait_for(path: Path, lines: int, proc: subprocess.Popen) -> None:
    """Until `path` has `lines` lines, written by the run `proc`."""

    def written() -> bool:
        return path.is_file() and len(path.read_text().splitlines()) >= lines

    until_sync(lambda: written() or proc.poll() is not None, f"{lines} lines in {path.name}", 300)
    assert written(), "the run ended before it could be signalled"


@pytest.mark.parametrize(("signum", "when"), [(signal.SIGTERM, "update"), (signal.SIGUSR1, "sampling")])
def test_a_signal_checkpoints_the_last_step_and_resume_ends_as_a_straight_run(signum, when, tmp_path):
    import preempt_worker

    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    preempt_worker.main(straight, resume=False)  # here: one process start fewer
    flag = "--hold" if when == "update" else "--slow"
    proc = subprocess.Popen([*WORKER, str(stopped), flag], stderr=subprocess.PIPE, text=True)
    if when == "update":  # step 2's advantages are computed: its update runs until the signal, and is finished
        _wait_for(stopped / "trained.jsonl", 2, proc)
    else:  # step 2 is logged: step 3 samples (600 s a request) and is abandoned
        _wait_for(stopped / "metrics.jsonl", 2, proc)
    os.kill(proc.pid, signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum
    assert err.strip().splitlines()[-1] == (
        f"error: preempted by {signal.Signals(signum).name} after step 2 of 4 (checkpoint of step 2 in "
        f"{stopped}/checkpoints); continue with the same command and --resume")
    assert "Traceback" not in err and "never retrieved" not in err
    assert (stopped / "checkpoints" / "latest").read_text().strip() == "step-000002"  # save_every 3: written at stop

    subprocess.run([*WORKER, str(stopped), "--resume"], check=True, timeout=300)
    trained = [json.loads(x) for x in (stopped / "trained.jsonl").read_text().splitlines()]
    whole = [json.loads(x) for x in (straight / "trained.jsonl").read_text().splitlines()]
    assert trained == whole  # steps 0-1 before the stop, 2-3 after: none skipped, none trained twice
    final, expected = torch.load(stopped / "final.pt"), torch.load(straight / "final.pt")
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in expected)
    assert any(not torch.equal(v, torch.zeros_like(v)) for v in expected.values())


def test_a_server_killed_ends_the_run_with_one_line_and_a_checkpoint(tmp_path):
    import preempt_worker

    straight, gone = tmp_path / "straight", tmp_path / "gone"
    preempt_worker.main(straight, resume=False)
    proc = subprocess.Popen([*WORKER, str(gone), "--stand-in", "--hold"], stderr=subprocess.PIPE, text=True)
    _wait_for(gone / "trained.jsonl", 2, proc)  # step 2 in its update (until the kill): its push finds the server gone
    server = int((gone / "server.pid").read_text())
    os.kill(server, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert err.strip().splitlines()[-1] == (
        f"error: vLLM server http://127.0.0.1:1 did not answer POST /pause?mode=wait (connection refused) "
        f"(checkpoint of step 2 in {gone}/checkpoints; continue with the same command and --resume once the "
        f"servers answer)")
    assert "Traceback" not in err and "never retrieved" not in err
    assert (gone / "checkpoints" / "latest").read_text().strip() == "step-000002"
    assert len((gone / "metrics.jsonl").read_text().splitlines()) == 2  # the step is logged as well

    subprocess.run([*WORKER, str(gone), "--resume"], check=True, timeout=300)
    final, expected = torch.load(gone / "final.pt"), torch.load(straight / "final.pt")
    assert all(torch.equal(final[k], expected[k]) for k in expected)


async def test_a_signal_before_the_first_step_ends_the_run_with_nothing_saved(tmp_path, smol_dir, renderer):
    run = scripted_run(tmp_path, smol_dir, renderer, toy_tasks(12))
    run.stop.request(signal.SIGTERM)
    with pytest.raises(Preempted) as e:
        await run_loop(run, TimedSampler(renderer, lambda prompt: 0.001))
    assert str(e.value).startswith("preempted by SIGTERM after step 0 of 8 (no step completed, nothing saved)")
    assert not (tmp_path / "checkpoints").exists()
