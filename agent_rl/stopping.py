"""Stopping a training run: a signal, a fault it cannot mend, and whether what it trained can be checkpointed.

Owns: `Preemption` (which signal came, SIGTERM or SIGUSR1, or which fault the run cannot mend: a server past its
restart budget, `fail`; and an event the loop can wait on beside its work), `watch` (the signal handlers,
installed in the event loop for the span of the training loop, the previous ones put back after),
`unless_stopped` (a piece of work, or None once a stop comes first), `mended` (from the rollout engine's typed
`Failures`: whether a step trained what an unfaulted run would, so its checkpoint holds nothing a fault changed),
and the one line a stopped run ends with: `Preempted` (its exit status 128 + the signal number, as a shell reports a
process a signal ended), `server_gone` (a push a server would not take, or a server past mending, with the
checkpoint to go on from), `end_of_run` (which of the two).
Does not own: what the loop does on a stop and what it checkpoints (`trainer.loop`, `trainer.stop`: the step being
sampled abandoned, one in its update finished, the last completed step checkpointed), mending (`rollout.supervisor`
restarts servers, `rollout.engine` replays episodes), how the line is printed (`commands.errors_as_lines`,
`cli.main`).

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
from collections.abc import Awaitable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from agent_rl.core.types import Trajectory
from agent_rl.rollout.engine import Failures
from agent_rl.runs.checkpoint import latest_step

T = TypeVar("T")
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


async def unless_stopped(work: Awaitable[T], stop: Preemption) -> T | None:
    """`work`'s result, or None (and `work` cancelled) if a stop comes first."""
    task, stopped = asyncio.ensure_future(work), asyncio.ensure_future(stop.event.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, stopped):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, stopped, return_exceptions=True)
    return task.result() if task.done() and not task.cancelled() else None


def mended(failures: Failures, trajs: Sequence[Trajectory]) -> bool:
    """The step trained what an unfaulted run would: none of its episodes failed, or each failure was mended by a
    retry (a server that died may have failed the step's episodes, whose tasks a checkpoint would count as trained).
    Episodes replayed after their server died (`Failures.replayed`) are not failures."""
    return not any(t.infra_error for t in trajs) and failures.all_retried


def server_gone(run_dir: Path, error: Exception, saved: int | None) -> Exception:
    """`error` (of its own type), with where the run can go on from: step `saved`, or the last checkpoint written."""
    last = saved if saved is not None else latest_step(run_dir)
    where = f"checkpoint of step {last} in {run_dir}/checkpoints" if last else "no checkpoint written"
    return type(error)(f"{error} ({where}; continue with the same command and --resume once the servers answer)")


def end_of_run(stop: Preemption, done: int, steps: int, run_dir: Path) -> Exception:
    """The line a run stopped after `done` steps ends with (each completed step checkpointed by then): the fault's
    it could not mend, or `Preempted`'s."""
    if stop.error is not None:
        return server_gone(run_dir, stop.error, done or None)
    return Preempted(stop.signal_name or "SIGTERM", done, steps, run_dir, checkpoint=done > 0)
