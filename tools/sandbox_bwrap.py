"""The default sandbox backend: bubblewrap namespaces, one host uid per live sandbox, rlimits.

Owns: the bwrap command line (`bwrap_argv`), the uid pool (`UidPool`), killing whatever runs as a
sandbox uid (`kill_uid`), the "does bwrap work here" probe and `BwrapBackend`.
Does not own: rlimits, pipes and output capping (`tools.sandbox_subprocess`), the session protocol
and result types (`tools.sandbox_core`).

What a sandbox gets: new user, pid, net (loopback only), ipc, uts and cgroup namespaces and no
further user namespaces; a read-only root holding only /usr (and the /bin, /lib... links), a fresh
/proc, a minimal /dev, private size-limited tmpfs on /tmp (the work dir) and /dev/shm; an
environment of a few fixed variables (and bwrap itself is started with an empty one). It runs as a
host uid of its own (60000 + slot by default, no groups; prlimit and setpriv set rlimits and uid in
front of bwrap): RLIMIT_NPROC counts per uid, so without that a fork bomb could not be bounded, and
the kernel only lets a uid signal its own processes. The interpreter is pid 1 of its namespace
(`--as-pid-1`): when it exits the kernel kills everything it started, and bwrap reaps it itself
(bwrap's own init would be orphaned and linger as a zombie still counted against the uid). The
interpreter is the system
/usr/bin/python3, as anything under /root is unreadable to the sandbox uid.

Known gap: RLIMIT_AS is per process, so memory is bounded by nproc * memory_mb, not memory_mb;
a cgroup per slot would close that.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import os
import signal
import stat
import subprocess
import tempfile
import time

from agent_rl.tools.sandbox_core import SANDBOX_ENV, DriverSession, ExecResult, Limits, python_argv, run_oneshot
from agent_rl.tools.sandbox_subprocess import KillTree, LocalProc, host_tool, kill_group, limit_argv, spawn_local

PYTHON = "/usr/bin/python3"


def bwrap_argv(limits: Limits, command: list[str]) -> list[str]:
    argv = [host_tool("bwrap"), "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
    argv += ["--new-session", "--as-pid-1", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):  # merged-/usr links, or real dirs
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    tmp = str(limits.tmp_mb << 20)
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", tmp, "--tmpfs", "/dev/shm"]
    argv += ["--size", tmp, "--tmpfs", "/tmp", "--chdir", "/tmp", "--clearenv"]
    for key, value in SANDBOX_ENV.items():
        argv += ["--setenv", key, value]
    # Read-only last: a remount before a later bind would not cover it. /dev too, or its tmpfs
    # (no size limit) would take files.
    argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--"]
    return argv + command


def kill_uid(uid: int, spare: int | None = None) -> int:
    """SIGKILL every live process whose real uid is `uid`, except pid `spare`; how many were signalled."""
    hit = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == spare:
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as f:
                fields = dict(line.split(b":", 1) for line in f if line[:4] in (b"Stat", b"Uid:"))
        except (OSError, ValueError):
            continue
        if int(fields[b"Uid"].split()[0]) == uid and not fields[b"State"].strip().startswith(b"Z"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)
                hit += 1
    return hit


def sweep_uid(uid: int, spare: int | None = None, timeout_s: float = 2.0) -> None:
    """Kill until nothing of `uid` is left (a fork bomb forks while we kill), or until the deadline."""
    deadline = time.monotonic() + timeout_s
    while kill_uid(uid, spare) and time.monotonic() < deadline:
        time.sleep(0.002)


class UidPool:
    """Host uids for sandboxes: one per live sandbox, exclusive across processes through lock files.

    A lock file holds b"0" when its uid was left clean; anything else (a sandbox was killed, or its
    holder died) gets the uid swept before reuse, so leftovers never count against the next run.
    """

    def __init__(self, base: int = 60000, size: int = 256, lock_dir: str | None = None):
        if base <= 0 or size <= 0:
            raise ValueError(f"uid pool needs base > 0 and size > 0, got base={base} size={size}")
        self.base, self.size = base, size
        self.lock_dir = lock_dir or os.path.join(tempfile.gettempdir(), "agent-rl-sandbox-uids")
        self._held: dict[int, int] = {}  # uid -> its locked file descriptor
        self._next = 0

    def _open(self, uid: int) -> int:
        os.makedirs(self.lock_dir, mode=0o700, exist_ok=True)
        st = os.lstat(self.lock_dir)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise RuntimeError(f"uid lock dir {self.lock_dir} must be our own directory, not writable by others")
        return os.open(os.path.join(self.lock_dir, str(uid)), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)

    def try_acquire(self) -> int | None:
        for i in range(self.size):
            uid = self.base + (self._next + i) % self.size
            if uid in self._held:
                continue
            fd = self._open(uid)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if os.pread(fd, 1, 0) != b"0":
                sweep_uid(uid)
            os.pwrite(fd, b"1", 0)
            self._held[uid] = fd
            self._next = (uid - self.base + 1) % self.size  # rotate: a just-freed uid rests a while
            return uid
        return None

    async def acquire(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while (uid := self.try_acquire()) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"all {self.size} sandbox uids from {self.base} are busy")
            await asyncio.sleep(0.01)
        return uid

    def release(self, uid: int, dirty: bool) -> None:
        fd = self._held.pop(uid)
        try:
            if dirty:
                sweep_uid(uid)
            if not dirty or kill_uid(uid) == 0:
                os.pwrite(fd, b"0", 0)
        finally:
            os.close(fd)


@functools.cache
def shared_pool() -> UidPool:
    """The uid pool of this process (uids are a machine-wide resource; lock files share it further)."""
    return UidPool()


def _sandbox_killer(uid: int) -> KillTree:
    async def kill(proc: asyncio.subprocess.Process) -> None:
        # Kill the sandbox first and let bwrap reap its child and exit: killing bwrap first would
        # orphan the sandbox's pid 1 as a zombie still counted against the uid.
        await asyncio.to_thread(sweep_uid, uid, proc.pid)
        with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
            await asyncio.wait_for(asyncio.shield(proc.wait()), 2)
        if proc.returncode is None:
            await kill_group(proc)

    return kill


@functools.cache
def unavailable_reason(python: str = PYTHON) -> str | None:
    """None when bwrap can build the sandbox here (tried once, as an unprivileged uid); else why not."""
    try:
        host_tool("bwrap")
    except RuntimeError:
        return "bwrap is not installed (apt-get install bubblewrap)"
    if not os.access(python, os.X_OK):
        return f"{python} is missing"
    try:
        # As nobody, without rlimits (nobody may run processes elsewhere): can an unprivileged uid do it?
        as_nobody = [host_tool("setpriv"), "--reuid=65534", "--regid=65534", "--clear-groups"]
        argv = (as_nobody if os.geteuid() == 0 else []) + bwrap_argv(Limits(), [python, "-c", "pass"])
        done = subprocess.run(argv, env={}, cwd="/", capture_output=True, timeout=10)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        return f"bwrap failed to start: {e}"
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines() or [f"exit code {done.returncode}"]
        return f"bwrap cannot create a sandbox here: {lines[-1]}"
    return None


class BwrapBackend:
    """Runs code under bubblewrap, each live sandbox as its own host uid (see the module docstring)."""

    name = "bubblewrap"

    def __init__(self, limits: Limits | None = None, python: str = PYTHON, pool: UidPool | None = None):
        self.limits = limits or Limits()
        self.python = python
        # Without root there is no uid to switch to: the sandbox runs as us, and NPROC is not set
        # (it would count all of our own processes).
        self.pool = pool or (shared_pool() if os.geteuid() == 0 else None)

    async def run(self, code: str) -> ExecResult:
        return await run_oneshot(self._spawn, code, self.limits)

    def session(self) -> DriverSession:
        return DriverSession(self._spawn, self.limits)

    async def _spawn(self, session: bool) -> LocalProc:
        sandbox = bwrap_argv(self.limits, python_argv(self.python, session, self.limits))
        if self.pool is None:
            return await spawn_local(limit_argv(self.limits, session) + sandbox, cwd="/", env={})
        pool, uid = self.pool, await self.pool.acquire(self.limits.wall_s)
        try:
            return await spawn_local(
                limit_argv(self.limits, session, uid) + sandbox,
                cwd="/",
                env={},
                kill_tree=_sandbox_killer(uid),
                on_close=lambda dirty: pool.release(uid, dirty),
            )
        except BaseException:
            pool.release(uid, dirty=True)
            raise
