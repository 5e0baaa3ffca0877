"""The messages on a tool worker's pipes: a pickle's length (4 bytes, big-endian), then the pickle.

Owns: writing one (`frame`, `write_all`, `write_message`), reading one from a blocking stream
(`read_message`: the worker's side), and how much a pipe holds (`pipe_size`).
Does not own: the worker processes (`tools.worker_pool`), the loop the worker runs (`tools.worker`).
"""

from __future__ import annotations

import fcntl
import pickle
import select
from typing import Any


def frame(message: Any) -> bytes:
    """`message` as the bytes on a pipe: its pickle's length, then the pickle."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(4, "big") + data


def write_all(stream: Any, data: bytes) -> None:
    """Every byte of `data` to an unbuffered stream (one write may take only part of it)."""
    view = memoryview(data)
    while view:
        view = view[stream.write(view):]


def write_message(stream: Any, message: Any) -> None:
    write_all(stream, frame(message))
    stream.flush()


def pipe_size(stream: Any) -> int:
    """The bytes a pipe holds (Linux: F_GETPIPE_SZ, 64 KiB by default; elsewhere the least POSIX promises)."""
    try:
        return int(fcntl.fcntl(stream.fileno(), fcntl.F_GETPIPE_SZ))
    except (AttributeError, OSError):
        return select.PIPE_BUF


def read_message(stream: Any) -> Any:
    def exactly(n: int) -> bytes:
        chunks = b""
        while len(chunks) < n:
            chunk = stream.read(n - len(chunks))
            if not chunk:
                raise EOFError("the worker process closed its pipe")
            chunks += chunk
        return chunks

    return pickle.loads(exactly(int.from_bytes(exactly(4), "big")))
