"""Faults a run meets, each ending in one line (`stopping.mended`, `stopping.server_gone`, `trainer.checkpoint`,
`commands.errors_as_lines`): whether a step can be checkpointed after its push failed, the line for a server
gone, a disk that fills during a checkpoint (the last good one stays readable)."""

from __future__ import annotations

import errno
from collections import Counter
from pathlib import Path

import pytest
from helpers import scripted_run, toy_tasks, trajectory

from agent_rl import stopping, trainer
from agent_rl.commands import CLIError, errors_as_lines
from agent_rl.core.types import StopReason
from agent_rl.rollout.engine import Failures
from agent_rl.rollout.weight_sync.base import WeightSyncError
from agent_rl.runs import checkpoint as checkpoints
from agent_rl.runs.checkpoint import latest_step, load_checkpoint
from agent_rl.stopping import Preempted


@pytest.mark.parametrize(("failures", "errors", "expected"), [
    (Failures(), [None, None], True),
    (Failures(Counter(ValueError=2), retried=2), [None], True),  # every failure retried: mended
    (Failures(Counter(ValueError=2), retried=1), [None], False),  # one failure not mended: a group refilled
    (Failures(Counter(SamplerError=1)), [None], False),  # a group dropped for it
    (Failures(), [None, "SamplerError: server down"], False),  # kept (on_error: keep) failures
    (Failures(replayed=3), [None], True),  # a restart's replays: no failure
    (Failures(Counter(group_reward=2, WorkerDied=1), retried=1), [None], False),  # every type counts
])
def test_a_step_is_mended_when_it_trained_what_an_unfaulted_run_would(failures, errors, expected):
    trajs = [trajectory(stop=StopReason.ERROR if e else StopReason.ENV_DONE, error=e) for e in errors]
    assert stopping.mended(failures, trajs) is expected


def test_failures_log_under_their_types():
    failures = Failures(Counter(ValueError=2, group_reward=1), retried=2, replayed=3)
    assert failures.metrics() == {"error/retried": 2.0, "fault/replayed_episodes": 3.0, "error/ValueError": 2.0,
                                  "error/group_reward": 1.0}
    assert failures.failed == 3 and not failures.all_retried


def test_the_line_for_a_server_gone_says_where_to_go_on_from(tmp_path, smol_dir, renderer):
    run = scripted_run(tmp_path, smol_dir, renderer, toy_tasks(3))
    error = WeightSyncError("vLLM server http://h:1 did not answer")
    assert str(stopping.server_gone(run.run_dir, error, None)) == (
        "vLLM server http://h:1 did not answer (no checkpoint written; continue with the same command and --resume "
        "once the servers answer)")
    trainer.checkpoint(run, 1, {"position": 0})
    assert str(stopping.server_gone(run.run_dir, error, None)).startswith(
        f"vLLM server http://h:1 did not answer (checkpoint of step 1 in {tmp_path}/checkpoints; ")


def test_a_disk_full_during_a_checkpoint_is_one_line_and_the_last_good_one_stays(tmp_path, smol_dir, renderer,
                                                                                  monkeypatch):
    run = scripted_run(tmp_path, smol_dir, renderer, toy_tasks(3))
    trainer.checkpoint(run, 1, {"position": 3})

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoints, "save_file", full)
    with pytest.raises(CLIError) as e, errors_as_lines():
        trainer.checkpoint(run, 2, {"position": 6})
    assert str(e.value) == (f"could not write the checkpoint of step 2 in {tmp_path}/checkpoints: [Errno 28] No "
                            f"space left on device (the checkpoint of step 1 stays readable)")
    assert e.value.code == 1 and latest_step(tmp_path) == 1
    ck = load_checkpoint(tmp_path, run.policy.model)
    assert ck is not None and ck.step == 1 and ck.data_position == {"position": 3}
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # the half-written folder is gone


def test_a_preempted_run_is_its_line_and_128_plus_the_signal():
    with pytest.raises(CLIError) as e, errors_as_lines():
        raise Preempted("SIGTERM", 1, 3, Path("runs/x"), checkpoint=True)
    assert e.value.code == 143 and str(e.value).startswith("preempted by SIGTERM after step 1 of 3 (checkpoint")
