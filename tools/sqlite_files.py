"""Read-only SQLite data files that are built once and never seen half-written.

Owns: `write_atomically` (build into a temp file, then rename over the target) and
`open_versioned` (open read-only and refuse a file whose `meta` table has another schema version).
Does not own: what goes in the files (`tools.search`, `tools.kg_service`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

from agent_rl.core.files import atomic_path


def write_atomically(path: str | Path, fill: Callable[[sqlite3.Connection], None]) -> Path:
    """Run `fill` on a fresh database at a temp path, commit, and rename it to `path`
    (`agent_rl.core.files.atomic_path`): a reader never sees a half-written file."""
    with atomic_path(path) as tmp:
        with sqlite3.connect(tmp) as db:
            fill(db)
        db.close()
    return Path(path).expanduser()


def open_versioned(path: Path, version: str, what: str, builder: str,
                   meta_columns: str = "version") -> tuple[sqlite3.Connection, tuple]:
    """Open `path` read-only (shareable across threads); returns it and its `meta` row.

    The first meta column must equal `version`; otherwise a one-line error says to rebuild.
    """
    if not path.exists():
        raise FileNotFoundError(f"no {what} at {path}; build it with {builder}")
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
    try:
        row = db.execute(f"SELECT {meta_columns} FROM meta").fetchone()
    except sqlite3.DatabaseError:
        row = None
    if not row or row[0] != version:
        db.close()
        raise ValueError(f"{path} is not a {version} {what}; delete it to rebuild")
    return db, row
