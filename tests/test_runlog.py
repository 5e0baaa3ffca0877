"""Run logging and plots: metrics.jsonl lines, TensorBoard events, resume truncation, the collapse
alarm on hand-made sequences, and the PNGs of `plot_run`."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from agent_rl.runs.plot import plot_run, plot_runs
from agent_rl.runs.runlog import CollapseAlarm, RunLogError, RunLogger, read_metrics


def lines(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def logger(run_dir, steps: int = 5, **kw) -> RunLogger:
    return RunLogger(run_dir, steps, tensorboard=kw.pop("tensorboard", False), progress=False, **kw)


# -- metrics.jsonl -----------------------------------------------------------------------------------
def test_one_json_line_per_step_written_before_exit(tmp_path):
    with logger(tmp_path) as lg:
        lg.log(1, {"reward_mean": 0.25, "tool_use_rate": 0.5, "train_tokens": 7})
        first = lines(tmp_path)  # on disk already: a kill now loses nothing
        lg.log(2, {"reward_mean": 0.75, "loss": float("nan")})
    assert len(first) == 1
    got = lines(tmp_path)
    assert [r["step"] for r in got] == [1, 2]
    assert got[0]["reward_mean"] == 0.25 and got[0]["train_tokens"] == 7.0
    assert got[1]["loss"] is None  # NaN written as null: strict JSON
    assert got[0]["alarm/tool_collapse"] == 0.0 and got[0]["alarm/entropy_collapse"] == 0.0
    assert got[0]["time"] <= got[1]["time"]


def test_log_needs_numbers_and_an_open_logger(tmp_path):
    lg = logger(tmp_path)
    with pytest.raises(RunLogError, match="outside its `with` block"):
        lg.log(1, {"x": 1.0})
    with lg, pytest.raises(TypeError, match="metric 'env' is not a number: 'calculator'"):
        lg.log(1, {"env": "calculator"})


def test_tensorboard_scalars_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with logger(tmp_path, tensorboard=True) as lg:
        for step, r in [(1, 0.1), (2, 0.3), (3, 0.5)]:
            lg.log(step, {"reward_mean": r, "tool_use_rate": 0.4})
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"reward_mean", "tool_use_rate", "alarm/tool_collapse"} <= set(acc.Tags()["scalars"])
    got = [(e.step, round(e.value, 6)) for e in acc.Scalars("reward_mean")]
    assert got == [(1, 0.1), (2, 0.3), (3, 0.5)]


# -- resume ----------------------------------------------------------------------------------------
def test_truncate_after_drops_later_steps_and_a_torn_line(tmp_path):
    with logger(tmp_path) as lg:
        for step in range(1, 6):
            lg.log(step, {"reward_mean": step / 10})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "reward_me')  # killed mid-write
    with logger(tmp_path) as lg:
        assert lg.truncate_after(3) == 3
        lg.log(4, {"reward_mean": 0.99})
    got = lines(tmp_path)
    assert [(r["step"], r["reward_mean"]) for r in got] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.99)]


def test_truncate_after_before_enter_and_without_a_file(tmp_path):
    lg = logger(tmp_path / "fresh")
    assert lg.truncate_after(0) == 0
    with lg:
        lg.log(1, {"reward_mean": 1.0})
    assert [r["step"] for r in lines(tmp_path / "fresh")] == [1]


def test_truncate_after_restores_the_alarm_peak(tmp_path, caplog):
    with logger(tmp_path) as lg:
        for step, rate in [(1, 0.3), (2, 0.6), (3, 0.5)]:
            lg.log(step, {"tool_use_rate": rate})
    with caplog.at_level(logging.WARNING, logger="agent_rl.runs.runlog"), logger(tmp_path) as lg:
        lg.truncate_after(3)
        logged = lg.log(4, {"tool_use_rate": 0.2})  # 0.2 < 0.5 x peak 0.6 of the resumed run
    assert logged["alarm/tool_collapse"] == 1.0
    assert "step 4: tool-use collapse: tool_use_rate 0.2 < 0.5 x running peak 0.6" in caplog.messages


def test_truncate_after_purges_tensorboard_events(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with logger(tmp_path, tensorboard=True) as lg:
        for step in range(1, 6):
            lg.log(step, {"reward_mean": step / 10})
    with logger(tmp_path, tensorboard=True) as lg:
        lg.truncate_after(3)
        lg.log(4, {"reward_mean": 0.99})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    got = [(e.step, round(e.value, 6)) for e in acc.Scalars("reward_mean")]
    assert got == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.99)]


# -- the alarm ---------------------------------------------------------------------------------------
def test_alarm_tool_collapse_after_a_meaningful_peak():
    alarm = CollapseAlarm(collapse_drop=0.5, entropy_floor=0.05)
    assert alarm.update({"tool_use_rate": 0.1}) == []
    assert alarm.update({"tool_use_rate": 0.0}) == []  # peak 0.1 < 0.2: noise, not a collapse
    assert alarm.flags()["alarm/tool_collapse"] == 0.0
    assert alarm.update({"tool_use_rate": 0.6}) == []
    assert alarm.update({"tool_use_rate": 0.31}) == []  # above 0.5 x 0.6
    assert alarm.update({"tool_use_rate": 0.2}) == ["tool-use collapse: tool_use_rate 0.2 < 0.5 x running peak 0.6"]
    assert alarm.flags() == {"alarm/tool_collapse": 1.0, "alarm/entropy_collapse": 0.0}
    assert alarm.update({"tool_use_rate": 0.1}) == []  # still collapsed: flagged, not warned again
    assert alarm.flags()["alarm/tool_collapse"] == 1.0
    assert alarm.update({"tool_use_rate": 0.5}) == []  # recovered
    assert alarm.flags()["alarm/tool_collapse"] == 0.0
    assert len(alarm.update({"tool_use_rate": 0.05})) == 1  # a new collapse is warned again


def test_alarm_entropy_floor_and_missing_keys():
    alarm = CollapseAlarm(collapse_drop=0.5, entropy_floor=0.05)
    assert alarm.update({"entropy": 0.3}) == []
    assert alarm.update({"entropy": 0.01}) == ["entropy collapse: entropy 0.01 < floor 0.05"]
    assert alarm.flags() == {"alarm/tool_collapse": 0.0, "alarm/entropy_collapse": 1.0}
    assert alarm.update({}) == [] and alarm.flags()["alarm/entropy_collapse"] == 0.0
    assert alarm.update({"entropy": float("nan"), "tool_use_rate": None}) == []


def test_logger_emits_alarm_warnings_and_flags(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="agent_rl.runs.runlog"):
        with logger(tmp_path, collapse_drop=0.5, entropy_floor=0.05) as lg:
            lg.log(1, {"tool_use_rate": 0.6, "entropy": 0.5})
            lg.log(2, {"tool_use_rate": 0.2, "entropy": 0.01})
    assert caplog.messages == ["step 2: tool-use collapse: tool_use_rate 0.2 < 0.5 x running peak 0.6",
                               "step 2: entropy collapse: entropy 0.01 < floor 0.05"]
    got = lines(tmp_path)
    assert [(r["alarm/tool_collapse"], r["alarm/entropy_collapse"]) for r in got] == [(0.0, 0.0), (1.0, 1.0)]


# -- missing packages ----------------------------------------------------------------------------------
def test_wandb_requested_but_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(RunLogError) as info:
        RunLogger(tmp_path, 3, tensorboard=False, wandb_project="demo")
    assert str(info.value) == ("run.wandb_project is set but wandb is not installed: pip install wandb, "
                               "or set run.wandb_project=null")
    assert not (tmp_path / "metrics.jsonl").exists()  # failed before anything was written


def test_tensorboard_requested_but_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(RunLogError, match=r"^TensorBoard logging needs the tensorboard package: "):
        RunLogger(tmp_path, 3, tensorboard=True)


# -- plots -----------------------------------------------------------------------------------------------
def test_plot_run_writes_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    with logger(tmp_path) as lg:
        for step in range(1, 5):
            lg.log(step, {"reward_mean": step / 4, "reward_std": 0.1, "reward/correct": step / 5,
                          "tool_use_rate": 0.5, "entropy": 0.4, "kl": 0.01 * step, "clip_frac": 0.02,
                          "zero_variance_group_share": 0.25, "tokens_mean": 300, "sampled_tokens_mean": 90,
                          "time/rollout_s": 30.0, "time/train_s": 40.0, "time/step_s": 72.0})
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["curves.png", "accuracy_tool_use.png"]
    for p in paths:
        assert p.parent == tmp_path / "plots"
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_run_skips_missing_keys(tmp_path):
    pytest.importorskip("matplotlib")
    with logger(tmp_path) as lg:
        lg.log(1, {"loss": 0.5})  # no key any panel knows (alarm flags are all 0 and plotted nowhere)
    assert plot_run(tmp_path) == []
    with logger(tmp_path) as lg:
        lg.log(2, {"reward_mean": 0.5})
    assert [p.name for p in plot_run(tmp_path)] == ["curves.png", "accuracy_tool_use.png"]


def test_plot_runs_draws_seeds_side_by_side(tmp_path):
    pytest.importorskip("matplotlib")
    for seed in (0, 1):
        with logger(tmp_path / f"grpo-seed{seed}") as lg:
            for step in range(1, 4):
                lg.log(step, {"reward/correct": step / (4 + seed), "tool_use_rate": step / 3})
    path = plot_runs([tmp_path / "grpo-seed0", tmp_path / "grpo-seed1"], tmp_path / "seeds.png")
    data = path.read_bytes()
    assert path == tmp_path / "seeds.png" and data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    (tmp_path / "grpo-seed2").mkdir()
    (tmp_path / "grpo-seed2" / "metrics.jsonl").write_text("")
    with pytest.raises(RunLogError, match=r"grpo-seed2/metrics.jsonl has no steps yet$"):
        plot_runs([tmp_path / "grpo-seed0", tmp_path / "grpo-seed2"], tmp_path / "x.png")


def test_plot_run_without_metrics(tmp_path):
    with pytest.raises(RunLogError) as info:
        plot_run(tmp_path)
    assert str(info.value) == f"no metrics.jsonl in {tmp_path}: not a run directory, or no step has finished yet"


def test_read_metrics_keeps_file_order(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 1}\n\n{"step": 2, "a": null}\n[1]\n')
    assert read_metrics(tmp_path) == [{"step": 1, "a": 1}, {"step": 2, "a": None}]


def test_logger_alarm_uses_the_run_config_thresholds(tmp_path):
    with logger(tmp_path, collapse_drop=0.9, entropy_floor=0.5) as lg:
        lg.log(1, {"tool_use_rate": 0.6, "entropy": 0.6})
        logged = lg.log(2, {"tool_use_rate": 0.5, "entropy": 0.4})  # 0.5 < 0.9 x 0.6; 0.4 < 0.5
    assert (logged["alarm/tool_collapse"], logged["alarm/entropy_collapse"]) == (1.0, 1.0)


def test_progress_bar_starts_at_the_resumed_step(tmp_path):
    with RunLogger(tmp_path, 10, tensorboard=False, start_step=3) as lg:
        assert lg._bar.n == 3
        lg.log(4, {"reward_mean": 0.5, "tool_use_rate": 0.25, "entropy": 1.5, "kl": 0.002})
        assert lg._bar.n == 4
        assert lg._bar.postfix == "reward=0.5 tools=0.25 entropy=1.5 kl=0.002"
