"""Warm worker processes for isolated tool calls: a pool per event loop, calls pipelined on each worker's pipe.

Owns: `run_in_worker` (call a function, by its address, in a worker process of the running loop's pool),
`WorkerPool` (up to `size` workers; which worker a call goes to; a worker's death, overrun or cancellation and the
calls it leaves behind), `_Worker` (one process, its pipes and the calls sent to it, in order), and the messages on
those pipes, both sides' (a pickle's length, 4 bytes big-endian, then the pickle: `frame`, `write_all`,
`write_message`; `read_message` from a blocking stream, the worker's side; `pipe_size`, how much a pipe holds).
Does not own: which tools run here and why (`tools.runners` says why, `tools.base` chooses), the worker's loop
(`tools.worker`).

How a call goes. It is sent to an idle worker, else to a worker started for it (up to `size`), else written behind
the calls a busy worker already has (at most `DEPTH` in all), else it waits for one of these. A worker reads its
requests one at a time and answers each in order, so the calls on one pipe run one after another: the first one
sent and not yet answered is the one running. Why pipeline: writing to a pipe whose reader sleeps wakes it, which
costs the writer several times a plain write (bench/tool_call.py, `pipe_write_cpu_us`); a request written while
its worker still works on the one before is read without a sleep, and the loop reads several replies per wake-up.
With hundreds of episodes in flight most calls find every worker busy. With 64 calls at once the loop's CPU per
call falls by nearly half against one call per worker at a time (`WorkerPool(depth=1)`, as the pool worked before;
bench/tool_call.py, `concurrent_loop_cpu_us`; both in docs/performance.md#the-bench-scripts). The price: a slow
call holds up the calls written behind it (at most `DEPTH` - 1), where one at a time they would have waited for
whichever worker freed first.

Deadlines. A call's deadline (`timeout_s`) starts when it starts to run (when the call before it on its pipe has
been answered, or when it is written to an idle worker): the wait for a worker, or behind other calls on its
pipe, does not count against it. It fires up to 1/32 of itself late (`core.deadline.Alarm`, whose loop timers
are shared). A call that overruns kills its worker (SIGKILL: a tool inside one long C call
can be stopped no other way); the calls written behind it, which never started, go to other workers, their
deadlines not yet begun. A worker that dies fails the call it was running ("the worker process exited"), and the
calls behind it go elsewhere. A call cancelled while it runs kills its worker too (its state is unknown); one
cancelled before it runs is answered into the void. A worker imports a tool's module once, before its first call,
under `START_TIMEOUT_S` and not the call's deadline.

An idle pool holds no reference to its loop, so a finished loop (and with it the pool, which then kills its
workers) can be collected.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import functools
import json
import os
import pickle
import select
import subprocess
import sys
import threading
import weakref
from typing import Any

from agent_rl.core.deadline import Alarm

POOL_SIZE = max(2, min(4, os.cpu_count() or 2))  # worker processes per event loop
DEPTH = 8  # calls written to one worker and not yet answered, the running one included
START_TIMEOUT_S = 120.0  # a worker's start-up and the import of a tool's module (not the call's deadline)
_BOOT = "import json, sys; sys.path[:] = json.loads(sys.argv[1]); from agent_rl.tools.worker import serve; serve()"


def frame(message: Any) -> bytes:
    """`message` as the bytes on a pipe: its pickle's length, then the pickle."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(4, "big") + data


def write_all(stream: Any, data: bytes) -> None:
    """Every byte of `data` to an unbuffered stream (one write may take only part of it)."""
    view = memoryview(data)
    while view:
        view = view[stream.write(view):]


def write_message(stream: Any, message: Any) -> None:
    write_all(stream, frame(message))
    stream.flush()


def pipe_size(stream: Any) -> int:
    """The bytes a pipe holds (Linux: F_GETPIPE_SZ, 64 KiB by default; elsewhere the least POSIX promises)."""
    try:
        return int(fcntl.fcntl(stream.fileno(), fcntl.F_GETPIPE_SZ))
    except (AttributeError, OSError):
        return select.PIPE_BUF


def read_message(stream: Any) -> Any:
    def exactly(n: int) -> bytes:
        chunks = b""
        while len(chunks) < n:
            chunk = stream.read(n - len(chunks))
            if not chunk:
                raise EOFError("the worker process closed its pipe")
            chunks += chunk
        return chunks

    return pickle.loads(exactly(int.from_bytes(exactly(4), "big")))


class _Call:
    """One request on a worker's pipe: a tool call (`reply` awaited by its caller) or the import of a tool's module
    before the first call of it on that worker (`for_call`: the call it was sent for, which its failure fails)."""

    __slots__ = ("message", "data", "timeout_s", "reply", "for_call", "timer", "worker", "abandoned")

    def __init__(self, message: tuple, timeout_s: float, reply: asyncio.Future | None,
                 for_call: _Call | None = None):
        self.message, self.timeout_s, self.reply, self.for_call = message, timeout_s, reply, for_call
        self.data = frame(message)
        self.timer: Alarm | None = None  # its deadline, once it runs
        self.worker: _Worker | None = None  # the worker it was written to
        self.abandoned = False  # its caller was cancelled before it ran: its reply goes nowhere

    @property
    def address(self) -> tuple[str, str]:
        return self.message[1], self.message[2]


class _Died(Exception):
    """A worker process ended while it ran `what` ("call" or "start"); the caller asks for its exit status."""

    def __init__(self, worker: _Worker, what: str):
        super().__init__(what)
        self.worker, self.what = worker, what


class _Worker:
    """One warm worker process: its pipes and the calls written to it, oldest (the one running) first. The loop
    watches its stdout from its first call until it is killed or closes the pipe; it refers to that loop weakly."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, json.dumps([str(p) for p in sys.path])],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        assert self.proc.stdin is not None and self.proc.stdout is not None  # PIPE
        self._out = self.proc.stdout.fileno()
        os.set_blocking(self._out, False)  # our end only: the worker's reads and writes still block
        self.received = bytearray()
        self.calls: collections.deque[_Call] = collections.deque()
        self.unread = 0  # bytes of the calls written and not yet answered: at most this much is in the pipe
        self.fits = pipe_size(self.proc.stdin)  # what the pipe holds: a request that fits is written at once
        self.loaded: set[tuple[str, str]] = set()  # modules imported (or being imported) there
        self.writing = False  # a request too large for the pipe is being written from a thread
        self.ended = False  # stdout reached its end: the worker exited
        self._watcher: weakref.ref[asyncio.AbstractEventLoop] | None = None

    def watch(self, loop: asyncio.AbstractEventLoop, on_readable: Any) -> None:
        if self._watcher is None:
            loop.add_reader(self._out, on_readable, self)
            self._watcher = weakref.ref(loop)

    def read(self) -> bytes | None:
        """What the worker wrote since the last read; b"" at its end; None when nothing is there yet."""
        try:
            return os.read(self._out, 1 << 16)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def replies(self) -> list[Any]:
        """The replies received whole, in order, taken out of the buffer."""
        out = []
        while len(self.received) >= 4:
            size = int.from_bytes(self.received[:4], "big")
            if len(self.received) - 4 < size:
                break
            out.append(pickle.loads(bytes(self.received[4:4 + size])))
            del self.received[:4 + size]
        return out

    def unwatch(self) -> None:
        """The loop stops reading stdout: before the pipe closes, so that no reader of a closed fd is left."""
        loop = None if self._watcher is None else self._watcher()
        self._watcher = None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._out)

    def kill(self) -> None:
        self.ended = True
        self.unwatch()
        if self.proc.poll() is None:
            self.proc.kill()
        try:  # reap it without blocking the loop
            threading.Thread(target=self.proc.wait, daemon=True).start()
        except RuntimeError:  # no new threads at interpreter shutdown: nothing left to reap it for
            pass
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass

    async def exit_status(self) -> int | str:
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.proc.wait), 2.0)
        except TimeoutError:
            return "unknown"


def _kill_all(workers: list[_Worker]) -> None:
    for w in list(workers):
        w.kill()


class WorkerPool:
    """Up to `size` warm worker processes serving the isolated tool calls of one event loop (module doc)."""

    def __init__(self, size: int = POOL_SIZE, depth: int = DEPTH):
        self.size, self.depth = size, depth
        self.workers: list[_Worker] = []
        self._waiting: collections.deque[_Call] = collections.deque()  # calls no worker could take yet
        weakref.finalize(self, _kill_all, self.workers)  # also at interpreter exit

    async def call(self, address: tuple[str, str], kwargs: dict[str, Any], timeout_s: float) -> tuple[str, Any]:
        """The worker's reply ("ok", content) / ("refused", ToolError text) / ("failed", "Type: text");
        TimeoutError past `timeout_s` once it runs, RuntimeError if its worker does not start or dies."""
        call = _Call(("call", *address, kwargs), timeout_s, asyncio.get_running_loop().create_future())
        self._waiting.append(call)
        self._dispatch()
        try:
            return await call.reply  # type: ignore[misc]  # a tool call has a reply
        except _Died as died:
            code = await died.worker.exit_status()
            raise RuntimeError(f"the worker process exited (status {code}) during the {died.what}") from None
        except asyncio.CancelledError:
            self._cancelled(call)
            raise

    def _dispatch(self) -> None:
        """Write the waiting calls to workers that can take them, in order (module doc)."""
        while self._waiting:
            call = self._waiting[0]
            if call.reply is None or call.reply.done():  # cancelled, or failed with a worker, while it waited
                self._waiting.popleft()
                continue
            try:
                worker = self._take(len(call.data))
            except OSError as e:  # no process could start (out of memory, of processes, of file descriptors)
                self._waiting.popleft()
                call.reply.set_exception(RuntimeError(f"a worker process could not start: {e}"))
                continue
            if worker is None:
                return
            self._waiting.popleft()
            if call.address not in worker.loaded:
                worker.loaded.add(call.address)
                self._send(worker, _Call(("load", *call.address), START_TIMEOUT_S, None, for_call=call))
            if not worker.ended:
                self._send(worker, call)
            elif not call.reply.done():  # the import's write found the worker dead while it ran another call,
                self._waiting.appendleft(call)  # which that death failed: this one waits for another worker

    def _take(self, size: int) -> _Worker | None:
        """An idle worker, else a new one, else the busy one with the fewest calls that has room for this one."""
        best = None
        for w in self.workers:
            if w.ended or w.writing:
                continue
            if not w.calls:
                return w
            if len(w.calls) < self.depth and w.unread + size <= w.fits and (best is None or len(w.calls) < len(
                    best.calls)):
                best = w
        if len(self.workers) < self.size:
            worker = _Worker()
            self.workers.append(worker)
            return worker
        return best

    def _send(self, worker: _Worker, call: _Call) -> None:
        """Write `call` behind the worker's others; a request larger than the pipe holds (only an idle worker gets
        one) is written from a thread, never on the loop."""
        loop = asyncio.get_running_loop()
        worker.watch(loop, self._readable)
        call.worker = worker
        worker.calls.append(call)
        worker.unread += len(call.data)
        if len(worker.calls) == 1:
            self._start(loop, worker, call)
        if worker.unread <= worker.fits:
            try:
                write_all(worker.proc.stdin, call.data)
            except OSError:  # it is dead (BrokenPipeError): the call it ran fails, the others go elsewhere
                self._retire(worker, "died")
            return
        worker.writing = True
        loop.run_in_executor(None, write_all, worker.proc.stdin, call.data).add_done_callback(
            lambda written: self._written(worker, written))

    def _written(self, worker: _Worker, written: asyncio.Future) -> None:
        worker.writing = False
        if not written.cancelled() and written.exception() is not None and not worker.ended:
            self._retire(worker, "died")  # the pipe broke: it is dead
        self._dispatch()

    def _start(self, loop: asyncio.AbstractEventLoop, worker: _Worker, call: _Call) -> None:
        """`call` runs now: its deadline starts (`core.deadline.Alarm`: up to 1/32 of it late, for a loop timer
        shared with every deadline ending in the same slice of time, not one of its own)."""
        call.timer = Alarm(loop, call.timeout_s, functools.partial(self._overrun, worker, call))

    def _readable(self, worker: _Worker) -> None:
        chunk = worker.read()
        if chunk is None:
            return
        if not chunk:
            self._retire(worker, "died")
            self._dispatch()
            return
        worker.received += chunk
        for reply in worker.replies():
            if not worker.calls:  # more replies than calls: not our worker's protocol; whatever it is, it ends
                self._retire(worker, "died")
                break
            call = worker.calls.popleft()
            worker.unread -= len(call.data)
            if call.timer is not None:
                call.timer.cancel()
            if call.reply is None:  # the import before a call: a failed one fails that call by itself
                if reply[0] != "ok":
                    worker.loaded.discard(call.address)
            elif not call.abandoned and not call.reply.done():
                call.reply.set_result(reply)
            if worker.calls:
                self._start(asyncio.get_running_loop(), worker, worker.calls[0])
        self._dispatch()

    def _overrun(self, worker: _Worker, call: _Call) -> None:
        if not worker.ended and worker.calls and worker.calls[0] is call:
            self._retire(worker, "overran")
            self._dispatch()

    def _cancelled(self, call: _Call) -> None:
        if call.worker is None:
            if call in self._waiting:
                self._waiting.remove(call)
        elif call.worker.calls and call.worker.calls[0] is call:  # it runs: the worker's state is unknown
            self._retire(call.worker, "cancelled")
            self._dispatch()
        else:
            call.abandoned = True

    def _retire(self, worker: _Worker, why: str) -> None:
        """Kill `worker`, which `why` ("died", "overran", "cancelled": the call it ran was): the call it ran (or
        the call its import was for) fails accordingly; the calls written behind it, which never started, wait
        for another worker, first in line."""
        worker.kill()
        if worker in self.workers:
            self.workers.remove(worker)
        calls = list(worker.calls)
        worker.calls.clear()
        if not calls:
            return
        head = calls[0]
        if head.timer is not None:
            head.timer.cancel()
        failed = head if head.reply is not None else head.for_call  # an import fails the call it was for
        what = "call" if head.reply is not None else "start"
        if why == "died":
            error: BaseException | None = _Died(worker, what)
        elif why == "overran":
            error = TimeoutError() if what == "call" else RuntimeError(
                f"the worker process did not start within {START_TIMEOUT_S:g} s")
        else:
            error = None
        if error is not None and failed is not None and failed.reply is not None and not failed.reply.done():
            failed.reply.set_exception(error)
        for call in reversed(calls[1:]):
            if call.reply is not None and not call.reply.done() and not call.abandoned:
                call.worker = None
                self._waiting.appendleft(call)


_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, WorkerPool] = weakref.WeakKeyDictionary()


async def run_in_worker(address: tuple[str, str], kwargs: dict[str, Any], timeout_s: float) -> tuple[str, Any]:
    """Call the function at `address` in a worker process of this event loop's pool (`WorkerPool.call`)."""
    loop = asyncio.get_running_loop()
    pool = _POOLS.get(loop)
    if pool is None:
        pool = _POOLS[loop] = WorkerPool()
    return await pool.call(address, kwargs, timeout_s)
