"""What every sandbox backend shares: the types, and one-shot runs and sessions over any `Proc`.

Owns: `Limits`, `ExecResult`, the `Backend`/`Session`/`Proc` protocols, the sandbox environment
(`SANDBOX_ENV`), how the interpreter is started (`python_argv`), one-shot runs and warm-interpreter
sessions written once on top of any backend's `Proc` (`run_oneshot`, `DriverSession`, `DRIVER`),
the output cap and result classification.
Does not own: how a process is isolated and started (`tools.sandbox_bwrap`, `tools.sandbox_docker`,
`tools.sandbox_subprocess`, which import this module and nothing above it), choosing a backend and
the text the model reads (`tools.sandbox`).

A backend only starts an interpreter and hands back a `Proc`: bytes in, `(stream, chunk)` out, and
`close()` which kills whatever is left and returns the exit code. One-shot runs feed the program on
stdin (`python -`); sessions run `DRIVER`, which reads `TOKEN SIZE\\n<code>` frames from stdin, runs
each in one persistent namespace, then writes `\\0TOKEN\\0` to stderr and `\\0TOKEN CODE KIND\\0` to
stdout, so the host knows where each call's output ends without a second channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Literal, Protocol

import pydantic
from pydantic import Field

Status = Literal["ok", "error", "timeout", "memory", "output_limit"]

# The whole environment a sandboxed program sees; nothing of the host's environment is passed on.
SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",  # BLAS/OpenMP pools sized to the host's cores would hit the nproc limit
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


class Limits(pydantic.BaseModel):
    """Resource limits of one sandboxed call (a one-shot run, or one call into a session)."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    wall_s: float = Field(10.0, gt=0, description="wall-clock seconds per call; then everything is killed")
    cpu_s: int = Field(10, gt=0, description="CPU seconds per process per call (RLIMIT_CPU)")
    memory_mb: int = Field(1024, gt=0, description="address space per process in MiB (RLIMIT_AS)")
    nproc: int = Field(64, gt=0, description="processes+threads of the sandbox uid (RLIMIT_NPROC)")
    file_size_mb: int = Field(16, gt=0, description="largest file a process may write, MiB (RLIMIT_FSIZE)")
    nofile: int = Field(256, gt=0, description="open file descriptors per process (RLIMIT_NOFILE)")
    output_bytes: int = Field(64 * 1024, gt=0, description="captured stdout, and stderr, bytes; more kills the run")
    tmp_mb: int = Field(64, gt=0, description="size of the private writable /tmp (the work dir), MiB")


@dataclass(frozen=True)
class ExecResult:
    status: Status  # "error": the code raised or exited non-zero
    stdout: str
    stderr: str
    exit_code: int  # shell convention: 128+N when killed by signal N
    seconds: float
    state_lost: bool = False  # sessions only: the interpreter was restarted, earlier variables are gone


class Proc(Protocol):
    """A started interpreter, as the shared one-shot and session logic drive it."""

    oom_killed: bool  # the backend knows the kernel killed it for memory (Docker's cgroup OOM)

    async def write(self, data: bytes, eof: bool = False) -> None: ...

    async def read(self) -> tuple[int, bytes]:
        """Next chunk as (1 for stdout or 2 for stderr, bytes); (0, b"") once both streams ended."""
        ...

    async def wait(self) -> int: ...

    async def close(self) -> int:
        """Kill whatever still runs, free the backend's resources, return the exit code. Idempotent."""
        ...


Spawn = Callable[[bool], Awaitable[Proc]]  # spawn(session) -> a one-shot `python -` or a DRIVER


class Session(Protocol):
    async def run(self, code: str) -> ExecResult: ...


class Backend(Protocol):
    name: str
    limits: Limits

    async def run(self, code: str) -> ExecResult:
        """Run a whole program in a fresh sandbox."""
        ...

    def session(self) -> AbstractAsyncContextManager[Session]:
        """A warm interpreter whose state persists between `run` calls."""
        ...


DRIVER = r"""
import linecache, os, resource, signal, sys
signal.signal(signal.SIGXCPU, lambda *_: os._exit(128 + signal.SIGXCPU))
_cpu = int(sys.argv[1])
_requests = os.fdopen(os.dup(0), "rb")
_null = os.open(os.devnull, os.O_RDONLY); os.dup2(_null, 0); os.close(_null)
_ns = {"__name__": "__main__", "__builtins__": __builtins__}
_n = 0
while True:
    _header = _requests.readline().split()
    if not _header:
        break
    _token, _src = _header[0], _requests.read(int(_header[1])).decode("utf-8", "replace")
    _n += 1
    _used = resource.getrusage(resource.RUSAGE_SELF)
    resource.setrlimit(resource.RLIMIT_CPU, (int(_used.ru_utime + _used.ru_stime) + 1 + _cpu, resource.RLIM_INFINITY))
    _code, _kind = 0, "-"
    try:
        _name = f"<cell {_n}>"
        linecache.cache[_name] = (len(_src), None, _src.splitlines(True), _name)
        exec(compile(_src, _name, "exec"), _ns)
    except SystemExit as e:
        _code = e.code if isinstance(e.code, int) else int(e.code is not None)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException as e:
        import traceback
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        _code, _kind = 1, type(e).__name__
    for _s in (sys.stdout, sys.stderr):
        try:
            _s.flush()
        except Exception:
            pass
    os.write(2, b"\0" + _token + b"\0")
    os.write(1, b"\0%s %d %s\0" % (_token, _code, _kind.encode()))
"""


def python_argv(python: str, session: bool, limits: Limits) -> list[str]:
    """How every backend starts the interpreter: -E -s ignore env and user site, -u keeps output on kill."""
    base = [python, "-E", "-s", "-u"]
    return base + (["-c", DRIVER, str(limits.cpu_s)] if session else ["-"])


def exit_code(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode


def classify(code: int, stderr: str, oom: bool) -> Status:
    if code == 0:
        return "ok"
    last = stderr.rstrip().rsplit("\n", 1)[-1]
    if oom or last.startswith("MemoryError"):
        return "memory"
    # SIGXCPU, or SIGKILL at the hard CPU limit; a sandbox's pid 1 cannot be SIGKILLed from inside
    if code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL):
        return "timeout"
    return "error"


async def _close(proc: Proc) -> int:
    """Close even when our caller is being cancelled, so no sandbox outlives its call."""
    task = asyncio.ensure_future(proc.close())
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task], timeout=10)
        raise


async def run_oneshot(spawn: Spawn, code: str, limits: Limits) -> ExecResult:
    """Run `code` as a whole program in a fresh interpreter, within `limits`."""
    start = time.monotonic()
    proc = await spawn(False)
    out = {1: bytearray(), 2: bytearray()}
    stopped: Status | None = None

    async def pump() -> None:
        nonlocal stopped
        with contextlib.suppress(OSError):  # it may exit without reading everything
            await proc.write(code.encode("utf-8", "replace"), eof=True)
        while (item := await proc.read())[0]:
            fd, chunk = item
            if len(out[fd]) + len(chunk) > limits.output_bytes:
                out[fd] += chunk[: limits.output_bytes - len(out[fd])]
                stopped = "output_limit"
                return
            out[fd] += chunk
        await proc.wait()

    try:
        await asyncio.wait_for(pump(), limits.wall_s)
    except TimeoutError:
        stopped = "timeout"
    finally:
        code_ = await _close(proc)
    stdout, stderr = (bytes(out[i]).decode(errors="replace") for i in (1, 2))
    return ExecResult(
        status=stopped or classify(code_, stderr, proc.oom_killed),
        stdout=stdout,
        stderr=stderr,
        exit_code=code_,
        seconds=time.monotonic() - start,
    )


async def _exchange(
    proc: Proc, token: bytes, code: str, out: dict[int, bytearray], cap: int
) -> tuple[Status | None, bytes]:
    """Send one call to a DRIVER and collect its output up to both end marks.

    Returns (None, b"EXIT_CODE KIND") when the call completed, else (failure, b"")."""
    payload = code.encode("utf-8", "replace")
    try:
        await proc.write(b"%s %d\n" % (token, len(payload)) + payload)
    except OSError:  # its stdin is gone: it died between calls
        return "error", b""
    marks = {1: b"\0" + token + b" ", 2: b"\0" + token + b"\0"}
    found: dict[int, int] = {}  # stream -> where its end mark starts
    trailer = b""
    while len(found) < 2 or not trailer:
        fd, chunk = await proc.read()
        if not fd:
            return "error", b""  # it died mid-call
        buf = out[fd]
        if fd in found and fd == 2:
            continue  # a background writer after the end mark; not this call's output
        buf += chunk
        if fd not in found:
            at = buf.find(marks[fd], max(0, len(buf) - len(chunk) - len(marks[fd])))
            if at < 0:
                if len(buf) > cap + len(marks[fd]) + 32:
                    return "output_limit", b""
                continue
            found[fd] = at
        if fd == 1 and (end := buf.find(b"\0", found[1] + len(marks[1]))) >= 0:
            trailer = bytes(buf[found[1] + len(marks[1]) : end])
    for fd, at in found.items():
        del out[fd][at:]
    return None, trailer


class DriverSession:
    """A warm interpreter fed snippets over its stdin; restarted, with state_lost, after a kill or crash."""

    def __init__(self, spawn: Spawn, limits: Limits):
        self._spawn, self.limits = spawn, limits
        self._proc: Proc | None = None
        self._lock = asyncio.Lock()
        self._lost_unreported = False  # a cancelled call killed it and could not say so

    async def __aenter__(self) -> DriverSession:
        self._proc = await self._spawn(True)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stop()

    async def _stop(self) -> int:
        proc, self._proc = self._proc, None
        return await _close(proc) if proc else 0

    async def run(self, code: str) -> ExecResult:
        async with self._lock:
            start, lost = time.monotonic(), self._lost_unreported
            self._lost_unreported = False
            if self._proc is None:  # the previous call lost it, and its result said so
                self._proc = await self._spawn(True)
            proc, out = self._proc, {1: bytearray(), 2: bytearray()}
            exchange = _exchange(proc, secrets.token_hex(8).encode(), code, out, self.limits.output_bytes)
            try:
                failure, trailer = await asyncio.wait_for(exchange, self.limits.wall_s)
            except TimeoutError:
                failure, trailer = "timeout", b""
            except asyncio.CancelledError:  # our caller gave up mid-call: the protocol state is unknown
                self._lost_unreported = True
                await self._stop()
                raise
            over = max(map(len, out.values())) > self.limits.output_bytes
            stdout, stderr = (bytes(out[i][: self.limits.output_bytes]).decode(errors="replace") for i in (1, 2))
            if failure is None:
                code_, kind = int(trailer.split(b" ")[0]), trailer.split(b" ")[-1]
                status: Status = "ok" if code_ == 0 else "memory" if kind == b"MemoryError" else "error"
                status = "output_limit" if over else status
                return ExecResult(status, stdout, stderr, code_, time.monotonic() - start, state_lost=lost)
            code_ = await self._stop()
            if failure == "error":  # it died: say why as for a one-shot run, but never "ok"
                died = classify(code_, stderr, proc.oom_killed)
                failure = "error" if died == "ok" else died
            return ExecResult(failure, stdout, stderr, code_, time.monotonic() - start, state_lost=True)
