"""Sandbox behaviour on well-behaved and simply failing code: statuses, sessions, formatting, tools, CLI.

Hostile code (bombs, escapes, floods) lives in test_sandbox_adversarial.py. The shared logic runs
here over bubblewrap and Docker (each where it works; in CI, which starts a daemon and sets
AGENT_RL_REQUIRE_DOCKER, Docker must work) and the plain subprocess backend (everywhere).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest
from helpers import REQUIRE_DOCKER, deadline_slack_s, docker_or_skip

from agent_rl.tools.base import Tool
from agent_rl.tools.python_tool import PythonSessionTool, PythonTool
from agent_rl.tools.sandbox import (
    SANDBOX_ENV,
    ExecResult,
    Limits,
    exec_cli,
    format_result,
    get_backend,
)
from agent_rl.tools.sandbox_bwrap import BwrapBackend, UidPool, unavailable_reason
from agent_rl.tools.sandbox_docker import DockerBackend, container_config
from agent_rl.tools.sandbox_subprocess import SubprocessBackend

pytestmark = pytest.mark.timeout(60)

LIMITS = Limits(wall_s=2, cpu_s=5, memory_mb=512, output_bytes=4096)
# Filling 512 MiB takes ~0.3 CPU s, but several seconds on a loaded 2-core machine: memory cases
# get a deadline far beyond that, so what they check is the memory limit, not the clock.
ROOMY = LIMITS.model_copy(update={"wall_s": 15})
BWRAP_MISSING = unavailable_reason()


@pytest.fixture(params=["bubblewrap", "docker", "subprocess"])
def backend(request):
    if request.param == "bubblewrap":
        if BWRAP_MISSING:
            pytest.skip(f"bubblewrap unavailable: {BWRAP_MISSING}")
        return BwrapBackend(LIMITS)
    if request.param == "docker":
        docker_or_skip()
        return DockerBackend(LIMITS)
    return SubprocessBackend(LIMITS)


async def test_ok_error_timeout_memory_statuses(backend):
    ok = await backend.run("print('hi'); import sys; print('warn', file=sys.stderr)")
    assert (ok.status, ok.stdout, ok.stderr, ok.exit_code) == ("ok", "hi\n", "warn\n", 0)

    err = await backend.run("x = 1\nraise ValueError('boom')")
    assert (err.status, err.exit_code) == ("error", 1)
    assert err.stderr.rstrip().endswith("ValueError: boom")

    exited = await backend.run("import sys; sys.exit(3)")
    assert (exited.status, exited.exit_code) == ("error", 3)

    slow = await backend.run("import time; print('started', flush=True); time.sleep(30)")
    assert (slow.status, slow.stdout) == ("timeout", "started\n")  # output before the kill is kept
    assert LIMITS.wall_s <= slow.seconds < LIMITS.wall_s + deadline_slack_s(backend)

    mem = await type(backend)(ROOMY).run("blocks = []\nwhile True: blocks.append(bytearray(10**7))")
    assert mem.status == "memory" and "MemoryError" in mem.stderr


async def test_memory_error_with_a_full_work_dir(backend):
    """Files in the work dir (tmpfs: memory) must not turn running out of memory into a silent kill."""
    fill = "for i in range(4):\n    open(f'fill{i}', 'wb').write(b'0' * (15 << 20))\n"
    mem = await type(backend)(ROOMY).run(fill + "blocks = []\nwhile True: blocks.append(bytearray(10**7))")
    assert (mem.status, mem.exit_code) == ("memory", 1) and mem.stderr.rstrip().endswith("MemoryError"), mem


async def test_cpu_limit_stops_a_busy_loop_before_the_wall_clock(backend):
    busy = await type(backend)(Limits(wall_s=40, cpu_s=1)).run("while True: pass")
    assert busy.status == "timeout"
    # killed by RLIMIT_CPU after 1 CPU second, not by the 40 s deadline; the gap is wide because
    # on a loaded 2-core machine a CPU second (and a container's start and removal) takes a while
    assert busy.seconds < 20


async def test_limits_and_identity_inside_the_sandbox(backend):
    code = (
        "import json, os, resource as r\n"
        "names = ('CPU', 'AS', 'FSIZE', 'NOFILE', 'NPROC')\n"
        "print(json.dumps([{n: r.getrlimit(getattr(r, 'RLIMIT_' + n)) for n in names}, os.getuid(), os.getgroups()]))"
    )
    result = await backend.run(code)
    rlimits, uid, groups = json.loads(result.stdout)
    mib = 1 << 20
    assert rlimits["CPU"] == [5, 5] and rlimits["AS"] == [512 * mib] * 2
    assert rlimits["FSIZE"] == [16 * mib] * 2 and rlimits["NOFILE"] == [256, 256]
    if isinstance(backend, BwrapBackend) and os.geteuid() == 0:
        assert 60000 <= uid < 60256 and groups == [] and rlimits["NPROC"] == [LIMITS.nproc] * 2


async def test_session_keeps_state_and_separates_call_output(backend):
    async with backend.session() as session:
        first = await session.run("x = 20\nprint('set')")
        second = await session.run("x += 22\nprint(x)")
        assert (first.stdout, second.stdout) == ("set\n", "42\n")
        failed = await session.run("print('before'); 1/0")
        assert (failed.status, failed.stdout, failed.state_lost) == ("error", "before\n", False)
        assert "ZeroDivisionError" in failed.stderr and "1/0" in failed.stderr  # the source line is shown
        assert (await session.run("print(x)")).stdout == "42\n"


async def test_session_protocol_survives_stdin_reads_and_fake_end_marks(backend):
    async with backend.session() as session:
        read = await session.run("y = 5\ninput()")
        assert read.status == "error" and "EOFError" in read.stderr and not read.state_lost
        fake = await session.run(r"print('\0' + 'deadbeef' * 2 + ' 0 -\0'); print('real')")
        assert fake.status == "ok" and fake.stdout.endswith("real\n")
        assert (await session.run("print(y)")).stdout == "5\n"


async def test_session_restarts_with_state_lost_after_timeout_crash_and_flood(backend):
    async with backend.session() as session:
        await session.run("x = 1")
        hung = await session.run("import time; time.sleep(30)")
        assert (hung.status, hung.state_lost) == ("timeout", True)
        assert (await session.run("print('x' in globals())")).stdout == "False\n"

        await session.run("x = 1")
        crashed = await session.run("import os; os._exit(7)")
        assert (crashed.status, crashed.exit_code, crashed.state_lost) == ("error", 7, True)

        flood = await session.run("while True: print('y' * 1000)")
        assert (flood.status, flood.state_lost) == ("output_limit", True)
        assert len(flood.stdout) <= LIMITS.output_bytes

        after = await session.run("print('fresh')")
        assert (after.status, after.stdout, after.state_lost) == ("ok", "fresh\n", False)


async def test_session_calls_run_in_one_warm_interpreter(backend):
    """Calls after the first reuse the interpreter the first started (its variables and its process): how fast
    that makes a call is bench/sandbox.py's figure, not a test's, which a loaded machine would time wrong."""
    async with backend.session() as session:
        first = await session.run("import os\nn = 0\nprint(os.getpid())")
        for _ in range(20):
            await session.run("n += 1")
        last = await session.run("print(n, os.getpid())")
    assert first.status == "ok" and last.stdout == f"20 {first.stdout.strip()}\n"


def test_format_result_text():
    ok = ExecResult("ok", "42\n", "", 0, 0.0123)
    assert format_result(ok) == "[ok | exit code 0 | 0.01 s]\nstdout:\n42"

    lost = ExecResult("timeout", "", "", 137, 3.0, state_lost=True)
    assert format_result(lost) == (
        "[timeout: the code ran past its time limit and was killed | exit code 137 | 3.00 s]\n(no output)\n"
        "[note: the Python interpreter was restarted; all variables, imports and files are lost]"
    )

    long = ExecResult("error", "a" * 50 + "b" * 50, "t" * 90 + "ValueError", 1, 0.5)
    text = format_result(long, max_chars=20)
    assert "stdout:\n" + "a" * 10 + "\n... [80 characters omitted] ...\n" + "b" * 10 in text
    assert "stderr:\n" + "t" * 5 + "\n... [80 characters omitted] ...\n" + "tttttValueError" in text


def test_limits_are_validated_and_frozen():
    with pytest.raises(pydantic.ValidationError, match="wall_s"):
        Limits(wall_s=0)
    with pytest.raises(pydantic.ValidationError, match="memory"):
        Limits(memory=1)  # a typo is an error, not a silently ignored field
    with pytest.raises(pydantic.ValidationError):
        LIMITS.wall_s = 5


def test_get_backend_names(caplog):
    with pytest.raises(ValueError, match="unknown sandbox backend 'nope'"):
        get_backend("nope")
    with caplog.at_level(logging.WARNING):
        assert get_backend("subprocess").name == "subprocess"
    assert "NOT isolated" in caplog.text
    if BWRAP_MISSING is None:
        assert get_backend(None).name == get_backend("auto").name == "bubblewrap"


async def test_tools_wrap_as_model_tools(backend):
    tool = Tool(PythonTool(backend).run_python)
    fn = tool.schema["function"]
    assert fn["name"] == "run_python" and fn["description"].startswith("Run a Python program")
    assert fn["parameters"]["properties"]["code"]["type"] == "string"
    assert fn["parameters"]["required"] == ["code"]
    result = await tool.call({"code": "print(6 * 7)"})
    assert result.ok and result.content.startswith("[ok | exit code 0 | ")
    assert result.content.endswith(" s]\nstdout:\n42")

    async with PythonSessionTool(backend) as session_tool:
        tool = Tool(session_tool.python)
        assert tool.name == "python"
        await tool.call({"code": "total = 40"})
        assert "stdout:\n42" in (await tool.call({"code": "print(total + 2)"})).content
    closed = await tool.call({"code": "print(1)"})
    assert not closed.ok and "not open" in closed.content


def test_exec_cli(tmp_path, capsys):
    program = tmp_path / "prog.py"
    program.write_text("print('from file')\n")
    assert exec_cli(str(program), None if BWRAP_MISSING is None else "subprocess") == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["status"], out["stdout"], out["state_lost"]) == ("ok", "from file\n", False)

    program.write_text("import sys; sys.exit(4)\n")
    assert exec_cli(str(program), "subprocess") == 4
    assert json.loads(capsys.readouterr().out)["status"] == "error"

    assert exec_cli(str(tmp_path / "missing.py"), "subprocess") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read" in err and "missing.py" in err

    assert exec_cli(str(program), "nope") == 2
    assert "unknown sandbox backend" in capsys.readouterr().err


def test_uid_pool_is_exclusive_across_holders_and_sweeps_leftovers(tmp_path):
    lock_dir = str(tmp_path / "uids")
    a, b = UidPool(base=61000, size=1, lock_dir=lock_dir), UidPool(base=61000, size=1, lock_dir=lock_dir)
    assert a.try_acquire() == 61000
    assert b.try_acquire() is None  # another holder (here: another open file, as another process would)
    if os.geteuid() != 0:
        a.release(61000, dirty=False)
        return
    # A process left behind under the uid by a killed run must not survive into the next one.
    leftover = subprocess.Popen(["sleep", "30"], user=61000, group=61000, extra_groups=[])
    try:
        a.release(61000, dirty=True)
        assert leftover.wait(timeout=5) == -signal.SIGKILL
        assert b.try_acquire() == 61000
        b.release(61000, dirty=False)
    finally:
        leftover.kill()
        leftover.wait()


def test_docker_container_config_locks_the_container_down():
    from docker.types import ContainerConfig, HostConfig

    config = container_config(LIMITS, "agent-rl-python", session=False)
    container = ContainerConfig("1.44", **{k: v for k, v in config.items() if k != "host_config"})
    assert container["Cmd"][-1] == "-" and container["StdinOnce"] is True  # the program arrives on stdin
    assert container["User"] == "65534:65534" and container["Labels"]["agent-rl.pid"] == str(os.getpid())
    assert container["Env"] == [f"{k}={v}" for k, v in SANDBOX_ENV.items()]  # nothing of the host
    host = HostConfig(version="1.44", **config["host_config"])  # the SDK accepts every setting
    assert host["NetworkMode"] == "none" and host["ReadonlyRootfs"] is True
    assert host["CapDrop"] == ["ALL"] and host["SecurityOpt"] == ["no-new-privileges"]
    # the cgroup holds one process at RLIMIT_AS, a full /tmp and /dev/shm (64 MiB each), 32 MiB of page cache
    assert host["Memory"] == host["MemorySwap"] == (512 + 2 * 64 + 32) << 20 and host["PidsLimit"] == LIMITS.nproc
    assert {u["Name"]: u["Hard"] for u in host["Ulimits"]}["cpu"] == LIMITS.cpu_s
    assert host["Tmpfs"]["/tmp"].startswith("rw,nosuid,nodev,size=64m")


async def test_cancelled_session_call_kills_and_reports_lost_state(backend):
    async with backend.session() as session:
        await session.run("x = 1")
        call = asyncio.ensure_future(session.run("import time; time.sleep(30)"))
        # time for the code to reach the sandbox (nothing outside says when it runs); a cancel before that loses
        # the session's state all the same, so a late start makes the test no less right
        await asyncio.sleep(0.3)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        after = await session.run("print('x' in globals())")
        assert (after.status, after.stdout, after.state_lost) == ("ok", "False\n", True)
        assert not (await session.run("pass")).state_lost


def test_docker_cases_fail_instead_of_skipping_when_ci_requires_docker(tmp_path):
    """.ci/run sets REQUIRE_DOCKER once its daemon is up: a Docker case that finds none must fail."""
    case = f"{__file__}::test_ok_error_timeout_memory_statuses[docker]"
    env = {**os.environ, REQUIRE_DOCKER: "1", "DOCKER_HOST": f"unix://{tmp_path}/no-daemon.sock"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", case],
        cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 1 and "1 error" in done.stdout, done.stdout[-2000:]  # failed in its fixture
    assert f"docker unavailable although {REQUIRE_DOCKER} is set: no Docker daemon answers" in done.stdout
