"""Preemption: SIGTERM or SIGUSR1 during training asks the loop to stop at a clean point.

Owns: `Preemption` (which signal came, or which fault the run cannot mend: a server past its restart budget,
`fail`; and an event the loop can wait on beside its work), `watch` (the
signal handlers, installed in the event loop for the span of the training loop, the previous ones put back
after), `Preempted` (the one line a stopped run ends with, and its exit status, 128 + the signal number, as
a shell reports a process a signal ended).
Does not own: what the loop does on a stop (`trainer.loop`: abandons the step being sampled, finishes one in
its update, checkpoints the last completed step), the servers (stopped by `session.sampling` as the
command unwinds), how the line is printed (`commands.errors_as_lines`, `cli.main`).

Why a flag, not an exception: SIGTERM elsewhere unwinds a command like Ctrl-C (`cli.raise_on_sigterm`), but
raised inside the training loop it lands in whichever task runs (a rollout worker, the middle of an
optimizer step in its thread's caller), leaves "Task exception was never retrieved" tracebacks behind, and
stops nothing at a point a checkpoint can describe. SLURM sends SIGUSR1 ahead of a job's end when asked
(`--signal=USR1@120`), Kubernetes and `scancel` send SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """Set once a stop signal came (`signal_name`), or a fault the run cannot mend (`error`: the loop stops the
    same way, and the run ends with that error's line); `event` wakes whoever waits on it. The first one counts."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.error: Exception | None = None
        self.event = asyncio.Event()

    @property
    def requested(self) -> bool:
        return self.signal_name is not None or self.error is not None

    def request(self, signum: int) -> None:
        if not self.requested:
            self.signal_name = signal.Signals(signum).name
            self.event.set()

    def fail(self, error: Exception) -> None:
        """A server that cannot be mended (`rollout.supervisor`): stop as for a signal, then end with `error`."""
        if not self.requested:
            self.error = error
            self.event.set()


class Preempted(Exception):
    """A run stopped by a signal: the line to print and the exit status (128 + signal number)."""

    def __init__(self, signal_name: str, done: int, steps: int, run_dir: Path, checkpoint: bool):
        self.code = 128 + int(signal.Signals[signal_name])
        where = (f"checkpoint of step {done} in {run_dir}/checkpoints" if checkpoint
                 else "no step completed, nothing saved")
        super().__init__(f"preempted by {signal_name} after step {done} of {steps} ({where}); "
                         f"continue with the same command and --resume")


@contextlib.contextmanager
def watch(preemption: Preemption) -> Iterator[Preemption]:
    """SIGTERM and SIGUSR1 set `preemption` while the block runs (main thread only: elsewhere Python runs no
    signal handlers, and the block watches nothing); the handlers before it are put back after it."""
    if threading.current_thread() is not threading.main_thread():
        yield preemption
        return
    loop = asyncio.get_running_loop()
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        loop.add_signal_handler(s, preemption.request, int(s))
    try:
        yield preemption
    finally:
        for s, handler in previous.items():
            loop.remove_signal_handler(s)  # leaves SIG_DFL behind: the previous handler goes back
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
