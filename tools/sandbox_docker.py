"""Docker sandbox backend, for hosts where bubblewrap cannot create namespaces but a daemon runs.

Owns: the container settings (`container_config`), `DockerProc` (one container driven over its
attach socket), the "does a daemon answer" probe and `DockerBackend`.
Does not own: the session protocol, output cap and result types (`tools.sandbox_core`).

Each call (or session) is one container: no network, read-only root, all capabilities dropped, no
new privileges, user nobody, memory (no swap) and pids limits, CPU/file-size/open-file ulimits and
a size-limited tmpfs on /tmp (the work dir). Code goes in over stdin, as with every backend.
RLIMIT_AS (`Limits.memory_mb`, so Python raises MemoryError as under bubblewrap) is set by a `sh`
wrapper that then execs python3: runc applies ulimits before loading seccomp, which an address-space
limit makes fail, so Docker refuses an "as" ulimit. The cgroup memory limit is the backstop for the
whole container (`cgroup_memory_mb`): room for what the limits let one process hold (its address
space, a full /tmp and /dev/shm, which tmpfs charges to the cgroup) plus the page cache of the files
it runs, so one process meets RLIMIT_AS and gets MemoryError, as under bubblewrap, rather than a
cgroup OOM kill with no traceback, or a stall while the kernel evicts the interpreter's own code.

The image needs /bin/sh and python3 with its standard library on PATH (python3-minimal is not
enough: sessions need `resource`). Build it offline, without a registry (`.ci/docker-image.sh`):

    debootstrap --variant=minbase --include=python3 bookworm ROOTFS
    tar -C ROOTFS -c . | docker import - agent-rl-python

The daemon is the one `docker.from_env` finds: DOCKER_HOST (e.g. unix:///path/docker.sock), else
/var/run/docker.sock.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import time
from typing import Any

from agent_rl.tools.sandbox_core import SANDBOX_ENV, DriverSession, ExecResult, Limits, python_argv, run_oneshot

IMAGE = "agent-rl-python"
CHUNK = 64 * 1024
PAGE_CACHE_MB = 32  # python3, its libraries and the stdlib modules a program imports, read into the cgroup


def cgroup_memory_mb(limits: Limits) -> int:
    """The container's memory (and memory+swap) limit in MiB: one process at RLIMIT_AS, both tmpfs
    full and its page cache fit; several processes together do not get past it."""
    return limits.memory_mb + 2 * limits.tmp_mb + PAGE_CACHE_MB


def container_config(limits: Limits, image: str, session: bool, python: str = "python3") -> dict[str, Any]:
    """Keyword arguments for the low-level `api.create_container`, with those of `create_host_config`
    under "host_config" (the high-level `containers.create` cannot ask for StdinOnce)."""
    from docker.types import Ulimit

    mib = limits.memory_mb
    cpu_hard = -1 if session else limits.cpu_s  # -1: unlimited; sessions raise their own soft limit per call
    return {
        "image": image,
        # sh sets RLIMIT_AS (ulimit -v: KiB, soft and hard), then execs: python3 is pid 1, argv verbatim
        "command": ["/bin/sh", "-c", f'ulimit -v {mib << 10} && exec "$@"', "sh"]
        + python_argv(python, session, limits),
        "stdin_open": True,
        "detach": False,  # with stdin_open: StdinOnce, so closing our side ends a one-shot program's stdin
        "user": "65534:65534",
        "working_dir": "/tmp",
        "environment": dict(SANDBOX_ENV),
        "labels": {"agent-rl": "sandbox", "agent-rl.pid": str(os.getpid())},  # who to blame for a leftover
        "host_config": {
            "log_config": {"type": "none"},  # output reaches us over attach; the daemon keeps no copy
            "network_mode": "none",
            "read_only": True,
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "mem_limit": f"{cgroup_memory_mb(limits)}m",
            "memswap_limit": f"{cgroup_memory_mb(limits)}m",  # no swap
            "pids_limit": limits.nproc,
            "ulimits": [
                Ulimit(name="cpu", soft=limits.cpu_s, hard=cpu_hard),
                Ulimit(name="fsize", soft=limits.file_size_mb << 20, hard=limits.file_size_mb << 20),
                Ulimit(name="nofile", soft=limits.nofile, hard=limits.nofile),
                Ulimit(name="core", soft=0, hard=0),
            ],
            "tmpfs": {"/tmp": f"rw,nosuid,nodev,size={limits.tmp_mb}m,mode=1777"},
            "shm_size": f"{limits.tmp_mb}m",
        },
    }


class DockerProc:
    """One container, its stdin/stdout/stderr multiplexed over the attach socket.

    The socket is driven by the event loop (non-blocking; Docker's 8-byte frame headers are parsed
    here), so a sandbox waiting for output holds no thread: the SDK's blocking reads each held one
    of the default executor's few threads (6 on 2 cores) for as long as the code ran.
    """

    def __init__(self, container: Any, sock: Any):
        self._container, self._sock = container, sock
        self._raw = getattr(sock, "_sock", sock)  # docker-py hands back a SocketIO over the socket
        self._raw.setblocking(False)
        self._buf = bytearray()
        self._started = int(time.time())
        self._eof = False
        self._code: int | None = None
        self._exited: int | None = None  # its exit status, once wait() has seen it
        self.oom_killed = False

    async def write(self, data: bytes, eof: bool = False) -> None:
        await asyncio.get_running_loop().sock_sendall(self._raw, data)
        if eof:
            self._raw.shutdown(socket.SHUT_WR)

    async def _take(self, size: int) -> bytes | None:
        """Exactly `size` bytes from the socket, or None when it ends first."""
        loop = asyncio.get_running_loop()
        while len(self._buf) < size:
            try:
                chunk = await loop.sock_recv(self._raw, max(CHUNK, size - len(self._buf)))
            except OSError:  # hung up by close(), or reset by the daemon
                chunk = b""
            if not chunk:
                return None
            self._buf += chunk
        taken = bytes(self._buf[:size])
        del self._buf[:size]
        return taken

    async def read(self) -> tuple[int, bytes]:
        while not self._eof:
            header = await self._take(8)  # stream (1 stdout, 2 stderr), 3 zero bytes, size (big-endian)
            payload = None if header is None else await self._take(int.from_bytes(header[4:], "big"))
            if header is None or payload is None:
                self._eof = True
            elif payload:
                return (2 if header[0] == 2 else 1), payload
        return 0, b""

    async def wait(self) -> int:
        self._exited = int((await asyncio.to_thread(self._container.wait))["StatusCode"])
        return self._exited

    def _oom_event_logged(self) -> bool:
        """Whether the daemon logged an "oom" event for this container. Docker 20.10 can leave
        State.OOMKilled false when containerd's OOM event is handled after its exit event."""
        events = self._container.client.api.events(
            since=self._started - 1, until=f"{time.time():.6f}", decode=True,
            filters={"container": self._container.id, "event": "oom"},
        )
        try:
            return any(True for _ in events)
        finally:
            events.close()

    def _hang_up(self) -> None:
        for step in (lambda: self._raw.shutdown(socket.SHUT_RDWR), self._raw.close, self._sock.close):
            with contextlib.suppress(Exception):
                step()

    async def close(self) -> int:
        if self._code is not None:
            return self._code
        import docker.errors

        try:
            # Hang up first: a daemon blocked writing output we no longer read (a flood past the cap)
            # stalls kill, wait and remove. Shut down the socket itself, not only docker-py's SocketIO.
            self._hang_up()
            if self._exited is None:  # still running, or not yet seen to exit
                with contextlib.suppress(docker.errors.APIError):  # 409: it has already exited
                    await asyncio.to_thread(self._container.kill)
                self._exited = int((await asyncio.to_thread(self._container.wait, timeout=10))["StatusCode"])
            self._code = self._exited
            if self._code == 128 + 9:  # SIGKILL: ours, the CPU limit's, or the cgroup OOM killer's
                await asyncio.to_thread(self._container.reload)
                self.oom_killed = bool(self._container.attrs.get("State", {}).get("OOMKilled"))
                if not self.oom_killed:
                    self.oom_killed = await asyncio.to_thread(self._oom_event_logged)
        finally:
            self._hang_up()
            with contextlib.suppress(docker.errors.APIError):
                await asyncio.to_thread(self._container.remove, force=True)
        return self._code


@functools.cache
def unavailable_reason(image: str = IMAGE) -> str | None:
    """None when a Docker daemon answers and has `image`; else why not."""
    try:
        import docker

        client = docker.from_env(timeout=3)
        client.ping()
    except Exception as e:  # no socket, refused, timeout, SDK missing: all mean "not here"
        return f"no Docker daemon answers ({type(e).__name__})"
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        return f"Docker image {image!r} is missing; build it as the tools/sandbox_docker.py docstring says"
    return None


class DockerBackend:
    """One container per one-shot run or session."""

    name = "docker"

    def __init__(self, limits: Limits | None = None, image: str = IMAGE, client: Any = None):
        import docker

        self.limits = limits or Limits()
        self.image = image
        self.client = client or docker.from_env(timeout=30)

    async def run(self, code: str) -> ExecResult:
        return await run_oneshot(self._spawn, code, self.limits)

    def session(self) -> DriverSession:
        return DriverSession(self._spawn, self.limits)

    def _create(self, session: bool) -> Any:
        config = container_config(self.limits, self.image, session)
        host_config = self.client.api.create_host_config(**config.pop("host_config"))
        created = self.client.api.create_container(**config, host_config=host_config)
        return self.client.containers.prepare_model({"Id": created["Id"]})  # no inspect round trip

    async def _spawn(self, session: bool) -> DockerProc:
        container = await asyncio.to_thread(self._create, session)
        try:
            params = {"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
            sock = await asyncio.to_thread(container.attach_socket, params=params)
            await asyncio.to_thread(container.start)
        except BaseException:
            await asyncio.to_thread(container.remove, force=True)
            raise
        return DockerProc(container, sock)
