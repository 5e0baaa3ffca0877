"""Local processes for the sandbox: the plumbing bubblewrap builds on, and the unisolated backend.

Owns: `limit_argv` (the prlimit/setpriv prefix that applies rlimits and switches uid), `spawn_local`
(start a process in its own session and process group with a clean environment), `LocalProc`
(pipes, kill, release of one local process tree) and `SubprocessBackend`.
Does not own: isolation. `SubprocessBackend` gives rlimits, a process-group kill and an output cap,
nothing more: the code runs as this user, sees this filesystem and network, and a daemon that calls
setsid() escapes the kill. It exists for trusted code and tests; `get_backend` warns when it is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable

from agent_rl.tools.sandbox_core import (
    SANDBOX_ENV,
    DriverSession,
    ExecResult,
    Limits,
    exit_code,
    python_argv,
    run_oneshot,
)

CHUNK = 64 * 1024
KillTree = Callable[[asyncio.subprocess.Process], Awaitable[None]]


async def kill_group(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


@functools.cache
def host_tool(name: str) -> str:
    """Absolute path of a host program we exec (prlimit, setpriv, bwrap), or a one-line error."""
    path = shutil.which(name) or shutil.which(name, path=os.defpath)
    if path is None:
        raise RuntimeError(f"{name} not found on PATH (prlimit and setpriv come with util-linux)")
    return path


def limit_argv(limits: Limits, session: bool, uid: int | None = None) -> list[str]:
    """Command prefix that sets the rlimits and, given `uid`, becomes that uid with no groups, then execs.

    Exec'd helpers rather than a preexec_fn: a preexec_fn forces a real fork() of the caller, which
    costs time in proportion to its resident memory (a trainer holds a lot:
    docs/performance.md#smaller-measurements); without one Python vforks.
    """
    mib = 1 << 20
    # A session raises its own soft CPU limit before each call (see DRIVER), so its hard one is open.
    cpu = f"{limits.cpu_s}:unlimited" if session else f"{limits.cpu_s}"
    argv = [host_tool("prlimit"), f"--cpu={cpu}", f"--as={limits.memory_mb * mib}", "--core=0"]
    argv += [f"--fsize={limits.file_size_mb * mib}", f"--nofile={limits.nofile}"]
    if uid is None:
        return argv
    # RLIMIT_NPROC counts per uid and is ignored for root: it only means something with a uid of our own.
    argv += [f"--nproc={limits.nproc}", host_tool("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    return argv


class LocalProc:
    """One local process tree: stdin, stdout and stderr pipes, and a kill that leaves nothing behind."""

    oom_killed = False

    def __init__(self, proc: asyncio.subprocess.Process, kill_tree: KillTree, on_close: Callable[[bool], None]):
        self._proc, self._kill_tree, self._on_close = proc, kill_tree, on_close
        assert proc.stdout is not None and proc.stderr is not None  # started with both piped
        self._streams = {1: proc.stdout, 2: proc.stderr}
        self._reads = {fd: asyncio.ensure_future(s.read(CHUNK)) for fd, s in self._streams.items()}
        self._code: int | None = None

    async def write(self, data: bytes, eof: bool = False) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(data)
        await self._proc.stdin.drain()
        if eof:
            self._proc.stdin.close()

    async def read(self) -> tuple[int, bytes]:
        while self._reads:
            await asyncio.wait(self._reads.values(), return_when=asyncio.FIRST_COMPLETED)
            for fd, task in list(self._reads.items()):
                if task.done():
                    chunk = task.result()
                    if chunk:
                        self._reads[fd] = asyncio.ensure_future(self._streams[fd].read(CHUNK))
                        return fd, chunk
                    del self._reads[fd]
        return 0, b""

    async def wait(self) -> int:
        return exit_code(await self._proc.wait())

    async def close(self) -> int:
        if self._code is not None:
            return self._code
        # Still running, or exited with its pipes held open by something it started: kill the tree.
        dirty = self._proc.returncode is None or bool(self._reads)
        for task in self._reads.values():
            task.cancel()
        # Drop our pipe ends first: asyncio only reports the exit once every pipe is closed, and
        # a pipe whose reader stopped (output cap) or a session's open stdin would never close.
        transport = self._proc._transport  # type: ignore[attr-defined]  # asyncio has no public accessor
        for fd in (0, 1, 2):
            if (pipe := transport.get_pipe_transport(fd)) is not None:
                pipe.close()
        try:
            if dirty:
                await self._kill_tree(self._proc)
            self._code = exit_code(await asyncio.wait_for(self._proc.wait(), 10))
        finally:
            if self._proc.returncode is None:
                transport.close()  # last resort: SIGKILL to what we started
            self._on_close(dirty)
        return self._code


async def spawn_local(
    argv: list[str],
    *,
    cwd: str,
    env: dict[str, str],
    kill_tree: KillTree = kill_group,
    on_close: Callable[[bool], None] = lambda dirty: None,
) -> LocalProc:
    """Start `argv` in a new session and process group with only `env`; pipes on 0, 1 and 2."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=cwd,
        env=env,
        start_new_session=True,
    )
    return LocalProc(proc, kill_tree, on_close)


class SubprocessBackend:
    """Rlimits, a process-group kill and an output cap; no isolation (see the module docstring)."""

    name = "subprocess"

    def __init__(self, limits: Limits | None = None, python: str = sys.executable):
        self.limits = limits or Limits()
        self.python = python

    async def run(self, code: str) -> ExecResult:
        return await run_oneshot(self._spawn, code, self.limits)

    def session(self) -> DriverSession:
        return DriverSession(self._spawn, self.limits)

    async def _spawn(self, session: bool) -> LocalProc:
        workdir = tempfile.mkdtemp(prefix="agent-rl-sandbox-")
        try:
            return await spawn_local(
                limit_argv(self.limits, session) + python_argv(self.python, session, self.limits),
                cwd=workdir,
                env={**SANDBOX_ENV, "HOME": workdir},
                on_close=lambda dirty: shutil.rmtree(workdir, ignore_errors=True),
            )
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
