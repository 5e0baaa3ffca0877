"""The Python tools the model calls: stateless runs and a persistent interpreter per trajectory.

Owns: `PythonTool` (`run_python`: every call a fresh sandbox) and `PythonSessionTool` (`python`:
one warm sandboxed interpreter per trajectory, an async context manager). Wrap the methods with
`tools.base.Tool`; they return the text the model reads (`tools.sandbox.format_result`).
Does not own: sandboxing (`tools.sandbox` and its backends) or tool schemas (`tools.base`).
"""

from __future__ import annotations

from typing import Any

from agent_rl.tools.sandbox import Backend, Limits, Session, format_result, get_backend


class PythonTool:
    """Stateless Python execution: nothing survives from one call to the next."""

    def __init__(self, backend: Backend | None = None, limits: Limits | None = None, max_chars: int = 4000):
        self.backend = backend or get_backend(None, limits)
        self.max_chars = max_chars

    async def run_python(self, code: str) -> str:
        """Run a Python program in a fresh sandbox and return what it printed.

        Each call starts a new interpreter without network access; variables, imports and files do
        not carry over to the next call.

        Args:
            code: A complete Python program. Print the results you want to see.
        """
        return format_result(await self.backend.run(code), self.max_chars)


class PythonSessionTool:
    """A persistent sandboxed Python interpreter for one trajectory: `async with` it, then call `python`."""

    def __init__(self, backend: Backend | None = None, limits: Limits | None = None, max_chars: int = 4000):
        self.backend = backend or get_backend(None, limits)
        self.max_chars = max_chars
        self._cm: Any = None
        self._session: Session | None = None

    async def __aenter__(self) -> PythonSessionTool:
        self._cm = self.backend.session()
        self._session = await self._cm.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        cm, self._cm, self._session = self._cm, None, None
        if cm is not None:
            await cm.__aexit__(*exc)

    async def python(self, code: str) -> str:
        """Run Python code in your persistent interpreter and return what it printed.

        Variables, functions and imports stay defined between calls, as in a notebook. There is no
        network access. If a call times out or crashes the interpreter is restarted and the result
        says so.

        Args:
            code: Python statements to run. Print the values you want to see.
        """
        if self._session is None:
            raise RuntimeError("PythonSessionTool is not open: use `async with PythonSessionTool() as tool`")
        return format_result(await self._session.run(code), self.max_chars)
