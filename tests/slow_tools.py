"""Deliberately slow and failing tools for tests/test_tool_deadline.py.

A module of its own, importing only the standard library and `tools.base`, because a worker process
imports it by name to run them: a test module would drag pytest and the environments in with it.
"""

from __future__ import annotations

import os
import time

from agent_rl.tools.base import ToolError

progress = [0]  # how far `spin` got: it must stop growing once spin's deadline has passed


def big_power(exponent: int) -> str:
    """7 ** exponent in one C call that holds the GIL (minutes for exponent 10**8); reports the worker's pid.

    Args:
        exponent: The power.
    """
    return f"pid {os.getpid()}: {(7 ** exponent).bit_length()} bits"


def spin(seconds: float) -> str:
    """Pure-Python busy work for `seconds`.

    Args:
        seconds: How long.
    """
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        progress[0] += 1
    return "done"


def refuse(text: str) -> str:
    """Refuse with a ToolError, or fail with a ValueError, or end the process.

    Args:
        text: "refuse", "fail", "exit", or "exit later" (half a second in: the calls written behind it are on its
            pipe when it ends, however slowly the caller writes them).
    """
    if text == "refuse":
        raise ToolError(f"refused {text!r}")
    if text == "fail":
        raise ValueError("a bug in the tool")
    if text == "exit later":
        time.sleep(0.5)
    os._exit(3)


def mirror(text: str, times: int) -> str:
    """`text` reversed, `times` times over: a reply far larger than the request, or the other way round.

    Args:
        text: What to mirror.
        times: How often.
    """
    return text[::-1] * times
