"""Sandboxed Python execution, the public face: choose a backend, and the text the model reads.

Owns: `get_backend` (which backend runs here, or the one asked for by name), `format_result` (the
tool message a result becomes) and `exec_cli` (`agent-rl sandbox exec`). Re-exports the shared
types (`Limits`, `ExecResult`, `Backend`, `Session`, `SANDBOX_ENV`, ...) so callers need one import.
Does not own: those types and the one-shot/session logic (`tools.sandbox_core`), isolation
(`tools.sandbox_bwrap`, `tools.sandbox_docker`, `tools.sandbox_subprocess`) or the model-facing
tools (`tools.python_tool`).

Imports only go down: this module imports the backends, and the backends import `tools.sandbox_core`,
never this module (tests/test_tools_imports.py checks that the `tools` imports form no circle).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sys
from pathlib import Path

from agent_rl.tools import sandbox_bwrap, sandbox_docker, sandbox_subprocess
from agent_rl.tools.sandbox_core import SANDBOX_ENV, Backend, ExecResult, Limits, Session, Status

__all__ = [  # the sandbox's public names: callers import them from here
    "BACKENDS", "SANDBOX_ENV", "Backend", "ExecResult", "Limits", "Session", "Status",
    "exec_cli", "format_result", "get_backend",
]

BACKENDS = ("auto", "bubblewrap", "docker", "subprocess")

log = logging.getLogger(__name__)


def get_backend(name: str | None = None, limits: Limits | None = None) -> Backend:
    """The backend called `name`; None or "auto": bubblewrap where it works, else Docker, else an error."""
    limits = limits or Limits()
    name = (name or "auto").lower()
    if name == "auto":
        bwrap_problem = sandbox_bwrap.unavailable_reason()
        if bwrap_problem is None:
            return sandbox_bwrap.BwrapBackend(limits)
        docker_problem = sandbox_docker.unavailable_reason()
        if docker_problem is None:
            return sandbox_docker.DockerBackend(limits)
        raise RuntimeError(
            f"no sandbox backend works here: bubblewrap: {bwrap_problem}; docker: {docker_problem} "
            "(backend 'subprocess' runs code unisolated and is only for trusted code)"
        )
    if name in ("bubblewrap", "bwrap"):
        problem = sandbox_bwrap.unavailable_reason()
        if problem:
            raise RuntimeError(f"sandbox backend bubblewrap unavailable: {problem}")
        return sandbox_bwrap.BwrapBackend(limits)
    if name == "docker":
        problem = sandbox_docker.unavailable_reason()
        if problem:
            raise RuntimeError(f"sandbox backend docker unavailable: {problem}")
        return sandbox_docker.DockerBackend(limits)
    if name == "subprocess":
        log.warning(
            "sandbox backend 'subprocess' is NOT isolated: model code runs as this user with full "
            "filesystem and network access; use it only for trusted code and tests"
        )
        return sandbox_subprocess.SubprocessBackend(limits)
    raise ValueError(f"unknown sandbox backend {name!r}; choose one of {', '.join(BACKENDS)}")


_HEADLINES = {
    "ok": "ok",
    "error": "error",
    "timeout": "timeout: the code ran past its time limit and was killed",
    "memory": "out of memory",
    "output_limit": "output limit: the code printed too much; output truncated, execution stopped",
}


def _clip(text: str, max_chars: int, head_share: float) -> str:
    if len(text) <= max_chars:
        return text
    head = int(max_chars * head_share)
    tail = max_chars - head
    return f"{text[:head]}\n... [{len(text) - max_chars} characters omitted] ...\n{text[len(text) - tail:]}"


def format_result(result: ExecResult, max_chars: int = 4000) -> str:
    """The tool message the model reads: status, output (long output keeps head and tail), lost state."""
    parts = [f"[{_HEADLINES[result.status]} | exit code {result.exit_code} | {result.seconds:.2f} s]"]
    if result.stdout:
        parts.append("stdout:\n" + _clip(result.stdout, max_chars, 0.5).rstrip("\n"))
    if result.stderr:  # tracebacks end with the useful line: keep more of the tail
        parts.append("stderr:\n" + _clip(result.stderr, max_chars, 0.25).rstrip("\n"))
    if not (result.stdout or result.stderr):
        parts.append("(no output)")
    if result.state_lost:
        parts.append("[note: the Python interpreter was restarted; all variables, imports and files are lost]")
    return "\n".join(parts)


def exec_cli(file: str, backend: str | None = None) -> int:
    """`agent-rl sandbox exec [--backend NAME] FILE`: print the ExecResult as JSON; exit like the code."""
    try:
        code = Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        print(f"error: cannot read {file}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(get_backend(backend).run(code))
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(dataclasses.asdict(result)))
    return 0 if result.status == "ok" else min(result.exit_code, 255) or 1
