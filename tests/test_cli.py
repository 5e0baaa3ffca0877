"""The command line: bad input ends in one `error: ...` line and a non-zero exit, never a traceback."""

from __future__ import annotations

import pytest
from helpers import alive, one_error_line, until_sync

from agent_rl.cli import main
from agent_rl.core.registry import EnvSpec
from agent_rl.envs.base import Env
from agent_rl.learn.models import ModelError, resolve_model


class RaisingEnv(Env):
    """An environment with a bug: it raises on its first step."""

    def __init__(self, task):
        self.task = task

    async def initial_messages(self):
        from agent_rl.core.types import Message

        return [Message("user", "hi")]

    async def step(self, reply, turn):
        raise RuntimeError("env bug: step exploded")

    async def reward(self, messages):
        return 0.0


def load_tasks(n, seed=0, split="train"):
    return [{"id": f"r{i}"} for i in range(n)]


ENV = EnvSpec("test_cli", RaisingEnv, load_tasks)  # this module doubles as an environment for `--env test_cli`


def test_missing_model_path(capsys):
    assert main(["rollout", "--model", "/no/such/model"]) == 2
    assert one_error_line(capsys) == ("error: model path '/no/such/model' does not exist "
                                      "(nor is it a hub id or a built-in: "
                                      "smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b)")


def test_model_errors_name_the_problem(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="is not a Hugging Face model folder .no config.json."):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ModelError, match="model path .*missing.gguf' does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ModelError, match="could not read GGUF file"):
        resolve_model(str(tmp_path / "bad.gguf"))


def test_hub_id_without_a_hub_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelError, match="could not load model 'someone/some-model' from the hub"):
        resolve_model("someone/some-model")


def test_unreachable_server(capsys):
    assert main(["rollout", "--server-url", "http://127.0.0.1:9", "--tasks", "1"]) == 1
    assert one_error_line(capsys) == "error: no vLLM server answers at http://127.0.0.1:9 (waited 10 s for /health)"


def test_unknown_environment(capsys):
    assert main(["rollout", "--env", "no_such_env_module"]) == 2
    assert one_error_line(capsys).startswith("error: unknown environment 'no_such_env_module' (built-in: calculator")


ENV_MODULE = ("from agent_rl.core.registry import EnvSpec\n\n\ndef make_env(task):\n    return task\n\n\n"
              "def load_tasks(n, seed=0, split='train'):\n    return [{}] * n\n\n\n"
              "ENV = EnvSpec('mine', make_env, load_tasks)\n")


def test_environment_from_the_current_folder_or_a_file(user_folder):
    from agent_rl.core.registry import load_env

    (user_folder / "cwd_env_a.py").write_text(ENV_MODULE)
    (user_folder / "sub").mkdir()
    (user_folder / "sub" / "file_env_b.py").write_text(ENV_MODULE)
    assert load_env("cwd_env_a").load_tasks(2) == [{}, {}]  # a console script has no "" on sys.path
    assert load_env("./sub/file_env_b.py").make_env({"x": 1}) == {"x": 1}
    assert load_env(str(user_folder / "sub" / "file_env_b.py")).name.endswith("file_env_b.py")
    assert load_env("calculator").solve is not None


@pytest.mark.parametrize("name, files, message", [
    ("./missing.py", {}, "environment file './missing.py' does not exist"),
    ("./notes.txt", {"notes.txt": ENV_MODULE},
     "environment file './notes.txt' must be a .py file named like a Python module"),
    ("./json.py", {"json.py": ENV_MODULE},
     "environment file './json.py' cannot be imported as 'json': that name is taken by "),
    ("broken_env_c", {"broken_env_c.py": "import no_such_package_x\n"},
     "environment 'broken_env_c' failed to import: No module named 'no_such_package_x'"),
    ("./syntax_env_d.py", {"syntax_env_d.py": "def f(:\n"},
     "environment './syntax_env_d.py' failed to import: SyntaxError: "),
    ("half_env_e", {"half_env_e.py": "def make_env(task):\n    return task\n"},
     "environment module 'half_env_e' defines make_env by name, which agent-rl no longer reads (0.1.0); export "
     'its spec: ENV = EnvSpec("half_env_e", make_env, load_tasks) (from agent_rl.core.registry import EnvSpec)'),
])
def test_environment_that_cannot_load_is_one_error_line(user_folder, capsys, name, files, message):
    for file, text in files.items():
        (user_folder / file).write_text(text)
    assert main(["play", name]) == 2
    assert one_error_line(capsys).startswith(f"error: {message}")


def test_invalid_config_exits_2_naming_the_field(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rollout:\n  group_sise: 4\n")
    assert main(["train", str(cfg)]) == 2
    assert one_error_line(capsys) == "error: config error: rollout.group_sise: unknown field"


@pytest.mark.integration
def test_environment_that_raises(capsys, vllm_server):
    code = main(["rollout", "--env", "test_cli", "--model", str(vllm_server.model_dir), "--server-url",
                 vllm_server.url, "--tasks", "1", "--group-size", "2", "--max-tokens", "120"])
    assert code == 1
    assert one_error_line(capsys) == "error: 2 of 2 rollouts failed; first: RuntimeError: env bug: step exploded"


SIGTERM_CHILD = r'''
import argparse, asyncio, subprocess, sys
from agent_rl import cli

class Server:  # stands in for a vLLM server: a process in its own session, stopped on exit
    def __enter__(self):
        self.proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
        print(self.proc.pid, flush=True)
        return self
    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()

async def run():
    with Server():
        print("ready", flush=True)
        await asyncio.sleep(120)

class Parser:
    def parse_args(self, argv):
        return argparse.Namespace(func=lambda args: asyncio.run(run()), verbose=False)

cli.build_parser = Parser
sys.exit(cli.main([]))
'''


def test_sigterm_unwinds_the_command_and_stops_what_it_started(tmp_path):
    """`kill` (or a scheduler's SIGTERM) ends a command the way Ctrl-C does: its `with` blocks run, so
    a server it started in its own session does not outlive it; one line, exit status 143."""
    import os
    import signal
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", SIGTERM_CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=os.getcwd())
    try:
        server_pid = int(child.stdout.readline())
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 143
    assert err.strip().splitlines()[-1] == "error: terminated (SIGTERM)"
    try:  # the stand-in server is gone (killed and reaped by the child)
        until_sync(lambda: not alive(server_pid), "the server the command started, gone with it", 5, every_s=0.05)
    finally:
        if alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)


STAND_IN_TEST = r'''
import subprocess, time
from pathlib import Path
import pytest

@pytest.fixture(scope="session")
def server():  # stands in for the vLLM server fixtures: a process in its own session
    proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()

def test_waits(server):
    Path("server.pid.part").write_text(str(server.pid))
    Path("server.pid.part").replace("server.pid")  # whole when it appears: the parent reads it at once
    time.sleep(120)
'''


def test_a_killed_test_session_stops_the_servers_its_fixtures_started(tmp_path):
    """tests/conftest.py turns SIGTERM into an interrupt, so pytest tears the session's fixtures down:
    a killed `make test` leaves no vLLM server behind (they live in their own session, out of reach of
    a signal to pytest's process group)."""
    import os
    import signal
    import subprocess
    import sys

    (tmp_path / "test_stand_in.py").write_text(STAND_IN_TEST)
    tests_dir = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                              "test_stand_in.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    pid_file = tmp_path / "server.pid"
    try:
        until_sync(lambda: pid_file.exists() or child.poll() is not None, "the stand-in server's pid file", 60,
                   every_s=0.05)
        assert pid_file.exists(), child.communicate(timeout=10)[0] if child.poll() is not None else "no pid"
        server_pid = int(pid_file.read_text())
        child.send_signal(signal.SIGTERM)
        out, _ = child.communicate(timeout=30)
    finally:
        child.kill()
    assert "KeyboardInterrupt" in out or "Terminated" in out, out
    try:
        until_sync(lambda: not alive(server_pid), "the stand-in server, gone with the killed test session", 5,
                   every_s=0.05)
    finally:
        if alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)


def test_sigusr1_unwinds_a_command_as_sigterm_does():
    """SLURM's warning signal: by default it would end the process at once and leave the servers it started."""
    import os
    import signal
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", SIGTERM_CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=os.getcwd())
    try:
        server_pid = int(child.stdout.readline())
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGUSR1)
        _, err = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 138
    assert err.strip().splitlines()[-1] == "error: terminated (SIGUSR1)"
    try:  # the stand-in server was killed and reaped by the child before it exited
        os.kill(server_pid, 0)
        os.kill(server_pid, signal.SIGKILL)
        raise AssertionError("the server the command started outlived it")
    except ProcessLookupError:
        pass
