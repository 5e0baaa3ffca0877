"""Hostile code against every isolating backend: each attack contained and reported, the next call fine.

Parametrised over bubblewrap and Docker (each skipped, with the reason, where it cannot run; a
Docker case fails instead where AGENT_RL_REQUIRE_DOCKER is set, as CI does). The unisolated
subprocess backend joins only the cases its rlimits, kill and output cap do cover.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import resource
import secrets
import socket
import tempfile

import pytest
from helpers import deadline_slack_s, docker_or_skip

from agent_rl.tools.sandbox import Limits
from agent_rl.tools.sandbox_bwrap import BwrapBackend, shared_pool
from agent_rl.tools.sandbox_bwrap import unavailable_reason as bwrap_missing
from agent_rl.tools.sandbox_docker import DockerBackend
from agent_rl.tools.sandbox_subprocess import SubprocessBackend

pytestmark = pytest.mark.timeout(60)

HOSTILE = Limits(wall_s=2, cpu_s=1, memory_mb=512, nproc=32, file_size_mb=8, tmp_mb=16, output_bytes=64 * 1024)


def make_backend(name: str, limits: Limits = HOSTILE):
    if name == "bubblewrap":
        if reason := bwrap_missing():
            pytest.skip(f"bubblewrap unavailable: {reason}")
        return BwrapBackend(limits)
    if name == "docker":
        docker_or_skip()
        return DockerBackend(limits)
    return SubprocessBackend(limits)


@pytest.fixture(params=["bubblewrap", "docker"])
def backend(request):
    return make_backend(request.param)


@pytest.fixture(params=["bubblewrap", "docker", "subprocess"])
def any_backend(request):
    return make_backend(request.param)


def pool_uid_processes() -> dict[int, list[str]]:
    """Every process (zombies included) running as a uid of the bubblewrap pool, by uid."""
    pool, found = shared_pool(), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if pool.base <= (uid := int(status["Uid"].split()[0])) < pool.base + pool.size:
            found.setdefault(uid, []).append(f"{pid} {status['Name'].strip()} {status['State'].strip()}")
    return found


def sandbox_uid_processes() -> list[str]:
    """Processes left under a pool uid that no live sandbox holds. Ours are all released by now; a
    uid whose lock another process holds is that process's live sandbox (another test run on this
    machine), so only uids whose lock we can take, and that still have processes then, count."""
    left = []
    for uid in pool_uid_processes():
        fd = os.open(os.path.join(shared_pool().lock_dir, str(uid)), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # held: a live sandbox of another process
        else:
            left += pool_uid_processes().get(uid, [])
        finally:
            os.close(fd)  # closing drops the lock
    return left


async def assert_contained(backend, result, statuses: set[str]) -> None:
    assert result.status in statuses, result
    if isinstance(backend, BwrapBackend):
        assert sandbox_uid_processes() == []
    if isinstance(backend, DockerBackend):  # every container of ours removed, whatever it did
        assert backend.client.containers.list(all=True, filters={"label": f"agent-rl.pid={os.getpid()}"}) == []
    after = await backend.run("print(6 * 7)")
    assert (after.status, after.stdout) == ("ok", "42\n")


async def test_fork_bomb(backend):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    await assert_contained(backend, await backend.run(bomb), {"timeout"})


async def test_thread_bomb(backend):
    bomb = (
        "import threading, time\n"
        "while True:\n"
        "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()"
    )
    result = await backend.run(bomb)
    assert "can't start new thread" in result.stderr or "MemoryError" in result.stderr
    await assert_contained(backend, result, {"error", "memory"})


async def test_subprocess_bomb(backend):
    bomb = (
        "import subprocess, sys\n"
        "children = []\n"
        "while True:\n"
        "    children.append(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']))"
    )
    result = await backend.run(bomb)
    # stopped by the process limit, or (on a loaded machine, where each Python child starts slowly)
    # killed with its whole group at the deadline before reaching it: contained either way
    if result.status == "timeout":
        assert result.seconds < HOSTILE.wall_s + deadline_slack_s(backend)
    else:
        assert "Resource temporarily unavailable" in result.stderr or "MemoryError" in result.stderr
    await assert_contained(backend, result, {"error", "memory", "timeout"})


async def test_busy_loop_and_long_sleep_time_out(any_backend):
    busy = await any_backend.run("while True: pass")
    assert busy.seconds < HOSTILE.wall_s + deadline_slack_s(any_backend)
    await assert_contained(any_backend, busy, {"timeout"})
    sleeper = await any_backend.run("import time\ntime.sleep(3600)")
    assert HOSTILE.wall_s <= sleeper.seconds < HOSTILE.wall_s + deadline_slack_s(any_backend)
    await assert_contained(any_backend, sleeper, {"timeout"})


async def test_memory_bomb(any_backend):
    # a deadline and CPU time it cannot run out of first, even on a loaded machine: memory must stop it
    roomy = type(any_backend)(HOSTILE.model_copy(update={"wall_s": 15, "cpu_s": 10}))
    result = await roomy.run("hoard = []\nwhile True:\n    hoard.append(bytearray(10**7))")
    await assert_contained(any_backend, result, {"memory"})


async def test_output_flood_is_capped_while_reading(any_backend):
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    flood = "import os\nchunk = b'x' * (1 << 20)\nfor _ in range(200):\n    os.write(1, chunk)"
    result = await any_backend.run(flood)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kib) / 1024
    assert len(result.stdout) == HOSTILE.output_bytes
    assert grown_mib < 50  # 200 MB were never buffered
    await assert_contained(any_backend, result, {"output_limit"})


async def test_secret_files_outside_the_sandbox_are_invisible(backend):
    secret = secrets.token_hex(16)
    # World-readable on purpose: only the sandbox's filesystem view may protect it.
    public_dir = tempfile.mkdtemp(prefix="agent-rl-secret-", dir="/tmp")
    private_dir = tempfile.mkdtemp(prefix="agent-rl-secret-", dir=os.path.expanduser("~"))
    paths = []
    for directory in (public_dir, private_dir):
        os.chmod(directory, 0o755)
        path = os.path.join(directory, "secret.txt")
        with open(path, "w") as f:
            f.write(secret)
        os.chmod(path, 0o644)
        paths.append(path)
    code = (
        f"for path in {paths!r} + ['/etc/shadow']:\n"
        "    try:\n"
        "        print(path, open(path).read())\n"
        "    except OSError as e:\n"
        "        print(path, 'refused', type(e).__name__)"
    )
    try:
        result = await backend.run(code)
    finally:
        for path in paths:
            os.remove(path)
            os.rmdir(os.path.dirname(path))
    assert secret not in result.stdout + result.stderr
    assert result.stdout.count("refused") == 3 and "root:" not in result.stdout
    await assert_contained(backend, result, {"ok"})


async def test_host_environment_does_not_leak(backend, monkeypatch):
    secret = secrets.token_hex(16)
    monkeypatch.setenv("AGENT_RL_TEST_SECRET", secret)
    code = (
        "import glob, os\n"
        "print(dict(os.environ))\n"
        "print('pid1', open('/proc/1/environ', 'rb').read())\n"
        "for path in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline'):\n"
        "    try:\n"
        "        print(path, open(path, 'rb').read())\n"
        "    except OSError as e:\n"
        "        print(path, e)"
    )
    result = await backend.run(code)
    assert "pid1" in result.stdout and "PATH" in result.stdout
    assert secret not in result.stdout and "AGENT_RL_TEST_SECRET" not in result.stdout
    await assert_contained(backend, result, {"ok"})


async def test_no_network_not_even_loopback(backend):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = (
            "import socket\n"
            f"for host, port in [('127.0.0.1', {port}), ('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
            "    try:\n"
            "        socket.create_connection((host, port), timeout=1).sendall(b'leak')\n"
            "        print('CONNECTED', host)\n"
            "    except OSError as e:\n"
            "        print('BLOCKED', host, e)"
        )
        result = await backend.run(code)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever reached the host's loopback
    assert "CONNECTED" not in result.stdout and result.stdout.count("BLOCKED") == 3
    await assert_contained(backend, result, {"ok"})


async def test_writes_outside_the_work_dir_fail(backend):
    host_dir = tempfile.mkdtemp(prefix="agent-rl-writable-", dir="/tmp")
    os.chmod(host_dir, 0o777)  # writable by anyone on the host: only the mount view may stop it
    target = os.path.join(host_dir, "escaped")
    code = (
        f"for path in ['/escaped', '/usr/escaped', '/etc/escaped', '/dev/escaped', {target!r}]:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('WROTE', path)\n"
        "    except OSError as e:\n"
        "        print('refused', path, type(e).__name__)\n"
        "open('work.txt', 'w').write('fine')\n"
        "print('work dir', open('work.txt').read())"
    )
    try:
        result = await backend.run(code)
        assert not os.path.exists(target)
    finally:
        os.rmdir(host_dir)
    assert "WROTE" not in result.stdout and "work dir fine" in result.stdout
    await assert_contained(backend, result, {"ok"})


async def test_large_file_and_full_tmp(backend):
    big = await backend.run("open('big', 'wb').write(b'0' * (100 << 20))")
    assert "File too large" in big.stderr
    await assert_contained(backend, big, {"error"})
    fill = "i = 0\nwhile True:\n    open(f'/tmp/f{i}', 'wb').write(b'0' * (4 << 20))\n    i += 1"
    full = await backend.run(fill)
    assert "No space left on device" in full.stderr
    await assert_contained(backend, full, {"error"})


async def test_killing_parent_and_pid1_hurts_nobody(backend):
    code = (
        "import os, signal\n"
        "for pid in (os.getppid(), 1, -1):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "    except OSError as e:\n"
        "        print('refused', pid, e)\n"
        "print('alive')"
    )
    result = await backend.run(code)
    assert result.stdout.endswith("alive\n")  # the sandbox's pid 1 ignores it; nothing else is visible
    await assert_contained(backend, result, {"ok"})


async def test_double_forked_daemon_dies_with_the_call(backend):
    token = secrets.token_hex(8)
    code = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {token!r}])\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"
        "print('parent exits')"
    )
    result = await backend.run(code)
    assert result.stdout == "parent exits\n"
    survivors = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    survivors.append(pid)
        except OSError:
            continue
    assert survivors == []
    await assert_contained(backend, result, {"ok"})


async def test_no_nested_user_namespace_and_no_root(backend):
    code = (
        "import os\n"
        "try:\n"
        "    import ctypes\n"
        "    libc = ctypes.CDLL(None, use_errno=True)\n"
        "    print('unshare', libc.unshare(0x10000000))  # CLONE_NEWUSER\n"
        "except ImportError:\n"
        "    print('unshare', -1, 'no ctypes')\n"
        "for name, call in [('setuid', lambda: os.setuid(0)), ('setgid', lambda: os.setgid(0)),\n"
        "                   ('setresuid', lambda: os.setresuid(0, 0, 0))]:\n"
        "    try:\n"
        "        call()\n"
        "        print(name, 'SUCCEEDED')\n"
        "    except OSError as e:\n"
        "        print(name, 'refused', e.errno)\n"
        "print('uid', os.getuid(), os.geteuid())"
    )
    result = await backend.run(code)
    assert "unshare -1" in result.stdout
    assert "SUCCEEDED" not in result.stdout and result.stdout.count("refused") == 3
    assert "uid 0 " not in result.stdout
    await assert_contained(backend, result, {"ok"})


@pytest.mark.timeout(180)  # 64 container starts took over 60 s on the 2-core machine under heavy load
@pytest.mark.parametrize("name", ["bubblewrap", "docker"])
async def test_64_concurrent_sandboxes_do_not_interfere(name):
    backend = make_backend(name, Limits(wall_s=30))
    code = "import os, time\ntime.sleep(0.3)\nprint({i}, os.getuid())"
    results = await asyncio.gather(*(backend.run(code.format(i=i)) for i in range(64)))
    assert [r.status for r in results] == ["ok"] * 64
    assert [int(r.stdout.split()[0]) for r in results] == list(range(64))
    if name == "bubblewrap" and os.geteuid() == 0:
        assert len({r.stdout.split()[1] for r in results}) == 64  # a uid of its own each
    await assert_contained(backend, results[0], {"ok"})
