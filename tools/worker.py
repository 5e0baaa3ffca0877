"""The worker process of isolated tools: read a request, call the tool, write the reply, repeat.

Owns: `serve`, the loop a worker process started by `tools.worker_pool` runs: requests on stdin, replies
on stdout (the tool's own prints go to stderr), each ("load" | "call", module, qualname[, kwargs])
answered by ("ok", content) / ("refused", ToolError text) / ("failed", "Type: text").
Does not own: starting, timing or killing workers, or the messages' bytes (`tools.worker_pool`), or what a reply
means to the model (`tools.base`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from agent_rl.tools.base import ToolError, tool_content
from agent_rl.tools.runners import resolve
from agent_rl.tools.worker_pool import read_message, write_message


def serve() -> None:
    if sys.platform == "linux":  # die with the parent, even in the middle of a computation
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    requests, replies = os.fdopen(os.dup(0), "rb", buffering=0), os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    while True:
        try:
            kind, module, qualname, *kwargs = read_message(requests)
        except EOFError:  # the parent closed the pipe or exited
            return
        try:
            fn = resolve(module, qualname)
            reply = ("ok", tool_content(fn(**kwargs[0])) if kind == "call" else None)
        except ToolError as e:
            reply = ("refused", str(e))
        except Exception as e:  # the tool's failure, told to the model by the parent
            reply = ("failed", f"{type(e).__name__}: {e}")
        write_message(replies, reply)
