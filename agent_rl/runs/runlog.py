"""Where a run's numbers go: metrics.jsonl, TensorBoard, optionally wandb, a progress bar, alarms.

Owns: `RunLogger` (one call per optimizer step writes every sink), the `metrics.jsonl` format and
its reader `read_metrics`, keeping that file consistent on resume (`truncate_after`), and
`CollapseAlarm`, the two warnings that tell you a tool-use run has gone wrong while it runs.
Does not own: computing metrics (`runs.metrics`, `learn.update`), plotting them (`runs.plot`),
checkpoints, atomic files (`core.files`).

metrics.jsonl holds one JSON object per step, `{"step": k, "time": unix_s, name: value, ...}`,
written with flush + fsync, so killing the run loses at most the step in progress. Non-finite
values are written as null (strict JSON). Steps are 1-based: `log(k, ...)` after step k is done.

Metric names read here (everything else is logged as is): `tool_use_rate` and `entropy` (the
alarm), and `reward_mean`, `tool_use_rate`, `entropy`, `kl` (the progress bar).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from agent_rl.core.files import write_lines

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
# (label in the progress bar, metric name)
POSTFIX = (("reward", "reward_mean"), ("tools", "tool_use_rate"), ("no-try", "tool/no_attempt_groups"),
           ("all-fail", "tool/all_fail_groups"), ("entropy", "entropy"), ("kl", "kl"))


class RunLogError(RuntimeError):
    """A logging sink cannot work (package missing, no metrics file); `str(e)` is one line."""


def _finite(x: Any) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


class CollapseAlarm:
    """Warns when the policy stops using its tools or its entropy collapses.

    Tool-use collapse: the tool-use rate falls below `collapse_drop` x its running peak, once that
    peak is at least `min_peak` (a drop from 0.05 to 0.02 is noise, from 0.6 to 0.2 is a run that
    learned to answer without tools). Entropy collapse: mean token entropy below `entropy_floor`
    (the policy has become deterministic and GRPO groups will stop differing).
    A warning is returned when a condition starts to hold, not again while it keeps holding (a
    1,000-step run would otherwise print it 1,000 times); `flags()` gives every step's state as 0/1.
    """

    def __init__(self, collapse_drop: float = 0.5, entropy_floor: float = 0.05, min_peak: float = 0.2,
                 tool_key: str = "tool_use_rate", entropy_key: str = "entropy"):
        self.collapse_drop, self.entropy_floor, self.min_peak = collapse_drop, entropy_floor, min_peak
        self.tool_key, self.entropy_key = tool_key, entropy_key
        self.tool_peak = 0.0
        self.tool_collapse = self.entropy_collapse = False

    def update(self, metrics: Mapping[str, Any]) -> list[str]:
        """Take one step's metrics; return its warnings (empty when all is well). Missing keys are skipped."""
        warnings = []
        was_tool, was_entropy = self.tool_collapse, self.entropy_collapse
        self.tool_collapse = self.entropy_collapse = False
        rate = _finite(metrics.get(self.tool_key))
        if rate is not None:
            self.tool_peak = max(self.tool_peak, rate)
            self.tool_collapse = self.tool_peak >= self.min_peak and rate < self.collapse_drop * self.tool_peak
            if self.tool_collapse and not was_tool:
                warnings.append(f"tool-use collapse: {self.tool_key} {rate:.3g} < {self.collapse_drop:g} x "
                                f"running peak {self.tool_peak:.3g}")
        entropy = _finite(metrics.get(self.entropy_key))
        if entropy is not None:
            self.entropy_collapse = entropy < self.entropy_floor
            if self.entropy_collapse and not was_entropy:
                warnings.append(f"entropy collapse: {self.entropy_key} {entropy:.3g} < floor {self.entropy_floor:g}")
        return warnings

    def flags(self) -> dict[str, float]:
        return {"alarm/tool_collapse": float(self.tool_collapse),
                "alarm/entropy_collapse": float(self.entropy_collapse)}


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of `<run_dir>/metrics.jsonl` in file order; a torn line (a kill mid-write) is skipped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise RunLogError(f"no {METRICS_FILE} in {run_dir}: not a run directory, or no step has finished yet")
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def _require_tensorboard():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise RunLogError("TensorBoard logging needs the tensorboard package: pip install tensorboard, "
                          "or set run.tensorboard=false") from None
    return SummaryWriter


def _require_wandb():
    try:
        import wandb
    except ImportError:
        raise RunLogError("run.wandb_project is set but wandb is not installed: pip install wandb, "
                          "or set run.wandb_project=null") from None
    return wandb


class RunLogger:
    """Context manager writing each step's metrics to every sink; see the module docstring.

    Missing packages are reported here, at construction, before any training time is spent.
    `start_step`: steps already done (resuming), where the progress bar starts; pair it with
    `truncate_after(start_step)`. `collapse_drop` / `entropy_floor` are `run.*` of the config.
    `config` (a plain dict, e.g. `cfg.model_dump()`) is stored with the wandb run.
    """

    def __init__(self, run_dir: str | Path, total_steps: int, tensorboard: bool = True,
                 wandb_project: str | None = None, *, start_step: int = 0, collapse_drop: float = 0.5,
                 entropy_floor: float = 0.05, config: dict[str, Any] | None = None, progress: bool = True):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.total_steps = total_steps
        self.alarm = CollapseAlarm(collapse_drop, entropy_floor)
        self.config = config
        self.progress = progress
        self.wandb_project = wandb_project
        self._summary_writer_cls: Any = _require_tensorboard() if tensorboard else None
        self._wandb = _require_wandb() if wandb_project else None
        self._purge_step: int | None = None
        self._last_step = start_step
        self._file: TextIO | None = None
        self._tb: Any = None  # tensorboard's SummaryWriter, once opened
        self._wandb_run: Any = None
        self._bar: Any = None
        self._stack = contextlib.ExitStack()

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> RunLogger:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._file = open(self.path, "a", encoding="utf-8")
            if self._wandb is not None:
                self._wandb_run = self._wandb.init(project=self.wandb_project, name=self.run_dir.name,
                                                   dir=str(self.run_dir), config=self.config)
            self._stack.enter_context(logging_redirect_tqdm())  # warnings print above the bar, not through it
            self._bar = tqdm(total=self.total_steps, initial=self._last_step, desc="train", unit="step",
                             disable=not self.progress, dynamic_ncols=True)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._stack.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def _open_tensorboard(self) -> None:
        """Opened at the first `log`, so that a resumed run writes one events file, after `truncate_after`.

        purge_step: TensorBoard discards the events at or after it that the run we resume left, but only
        in files it reads later; it reads them in name order, and a name starts with the second it was
        opened in. So a purging file waits (at most a second) for a second later than the newest file's."""
        folder = self.run_dir / TENSORBOARD_DIR
        if self._purge_step is not None:
            seconds = [int(p.name.split(".")[3]) for p in folder.glob("events.out.tfevents.*")
                       if p.name.split(".")[3].isdigit()]
            while seconds and time.time() < max(seconds) + 1:
                time.sleep(0.05)
        self._tb = self._summary_writer_cls(log_dir=str(folder), purge_step=self._purge_step, flush_secs=30)

    # -- writing -----------------------------------------------------------------------------------
    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Record step `step` (1-based) everywhere; returns the metrics as logged, alarm flags included."""
        if self._file is None:
            raise RunLogError("RunLogger.log called outside its `with` block")
        values: dict[str, float] = {}
        for key, value in metrics.items():
            try:
                values[key] = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"metric {key!r} is not a number: {value!r}") from None
        warnings = self.alarm.update(values)
        values.update(self.alarm.flags())

        record = {"step": step, "time": round(time.time(), 3),
                  **{k: (v if math.isfinite(v) else None) for k, v in values.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._summary_writer_cls is not None and self._tb is None:
            self._open_tensorboard()
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=step)
        if self._bar is not None:
            self._bar.update(max(step - self._bar.n, 0))
            shown = [f"{label}={values[key]:.3g}" for label, key in POSTFIX if key in values]
            self._bar.set_postfix_str(" ".join(shown), refresh=True)
        for warning in warnings:
            log.warning("step %d: %s", step, warning)
        self._last_step = step
        return values

    def truncate_after(self, step: int) -> int:
        """Resume at `step`: drop every metrics line after it, and TensorBoard's events after it.

        Replays the kept lines through the alarm so its running peak is that of the resumed run.
        Call it before or inside the `with` block, before the first `log`. Returns the lines kept.
        """
        kept = [r for r in read_metrics(self.run_dir) if r["step"] <= step] if self.path.is_file() else []
        reopen = self._file is not None
        if self._file is not None:
            self._file.close()
        write_lines(self.path, (json.dumps(r) for r in kept))
        if reopen:
            self._file = open(self.path, "a", encoding="utf-8")

        self.alarm.tool_peak = 0.0
        self.alarm.tool_collapse = self.alarm.entropy_collapse = False
        for record in kept:
            self.alarm.update(record)
        self._purge_step = step + 1
        if self._tb is not None:  # reopened, purging, at the next `log`
            self._tb.close()
            self._tb = None
        self._last_step = step
        if self._bar is not None:
            self._bar.n = self._bar.last_print_n = step
            self._bar.refresh()
        return len(kept)
