"""Files that are never seen half-written: build under a temp name next to the target, then rename.

Owns: `atomic_path` (a temp path for a file, renamed over the target on success), `atomic_file`,
`write_text`, `write_lines`, `write_json` (open-write-fsync-rename in one call) and `atomic_dir`
(a temp folder renamed to the target, replacing an older one). A kill at any point leaves either
the old target or the new one complete; temp leftovers of a killed run are removed by the next write.
Does not own: what goes in the files, or which files a run keeps (checkpoints, versions).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp path beside `path`; when the block succeeds it is renamed to `path`."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "w") -> Iterator[IO[Any]]:
    """An open file whose content replaces `path` (fsynced) only when the block succeeds."""
    with atomic_path(path) as tmp:
        with open(tmp, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())


def write_text(path: str | Path, text: str) -> Path:
    with atomic_file(path) as f:
        f.write(text)
    return Path(path)


def write_lines(path: str | Path, lines: Iterable[str]) -> Path:
    """One line per item (a newline added after each)."""
    with atomic_file(path) as f:
        for line in lines:
            f.write(line + "\n")
    return Path(path)


def write_json(path: str | Path, obj: Any) -> Path:
    """A JSON report (indented one space)."""
    with atomic_file(path) as f:
        json.dump(obj, f, indent=1)
    return Path(path)


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(parent: Path, prefix: str) -> None:
    """Temp folders `{prefix}{pid}-*` of processes that no longer run (killed mid-write)."""
    for stale in parent.glob(prefix + "*"):
        pid = stale.name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(path: str | Path, durable: bool = False, keep_existing: bool = False) -> Iterator[Path]:
    """Yield an empty temp folder beside `path`; when the block succeeds it becomes `path`.

    A folder already at `path` is replaced, or kept (ours discarded) with `keep_existing`: two
    processes building the same cache entry both end with a complete one. Temp folders left by a
    killed process are removed first. `durable`: fsync every file, the folder and its parent
    (checkpoints; not needed for files a server reads right away).
    """
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".tmp-{path.name}-"
    _remove_stale(path.parent, prefix)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{prefix}{os.getpid()}-"))
    try:
        yield tmp
        if durable:
            for file in tmp.rglob("*"):
                fsync_path(file)
            fsync_path(tmp)
        if path.exists():
            if keep_existing:
                return
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{prefix}{os.getpid()}-old-"))
            os.replace(path, old / "x")
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, path)
        if durable:
            fsync_path(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
