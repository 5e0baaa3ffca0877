"""The knowledge-graph API: an HTTP service over SQLite triples.

Owns: the triple store in SQLite (`KGStore`: build once, reopen read-only; entity lookup by exact,
alias, substring and fuzzy name), its aiohttp app (`kg_app`, `start_kg_service`) and `kg_serve_cli`.
Does not own: the facts themselves (`tools.countries`), the shared service plumbing
(`tools.http_service`), the search service (`tools.search_service`) or the agent-facing client
(`tools.kg.KGClient`).

Endpoints (GET with query parameters, or POST with a JSON object; JSON out):
  /entities  name, type?, limit?    entities whose name contains `name`, else the closest names
  /relations entity                 the relations an entity has, with how many values each
  /follow    entity, relation, limit?  the values of one relation
Every answer carries a `message` written for a language model; an empty result says what was asked
and what exists nearby, never a bare `[]`. Bad requests get 4xx and `{"error": "..."}`. An /entities
answer says with `matched` whether any name contained the query (false: what it lists are only the
closest names), so a client can tell an empty lookup from a found one (`tools.kg`'s bare mode).
"""

from __future__ import annotations

import asyncio
import difflib
import re
import signal
import sqlite3
import sys
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web

from agent_rl.tools.countries import LITERAL_TYPES, Triple, country_triples, entity_key
from agent_rl.tools.http_service import RequestError, Service, json_errors, request_params, serve
from agent_rl.tools.sqlite_files import open_versioned, write_atomically

DEFAULT_DB = Path("~/.cache/agent-rl/countries-kg.sqlite")
SCHEMA_VERSION = "countries-kg-1"


class KGError(RequestError):
    """A request the store cannot answer; `status` is the HTTP status, `message` says how to recover."""


def _pairs(key: str) -> set[str]:
    return {key[i : i + 2] for i in range(len(key) - 1)}


def _relation_key(relation: str) -> str:
    return re.sub(r"[\W_]+", "_", relation.strip().lower()).strip("_")


class KGStore:
    """Read-only triples in SQLite, indexed by subject; sync methods returning JSON-able dicts."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._db, _ = open_versioned(self.path, SCHEMA_VERSION, "knowledge graph", "KGStore.build")
        # entity key -> (display name, types, number of facts); small enough to scan for fuzzy lookup
        self.entities = {k: (n, sorted(t.split(",")), c) for k, n, t, c in self._db.execute("SELECT * FROM entities")}
        self.types = sorted({t for _, types, _ in self.entities.values() for t in types})
        self.aliases: dict[str, set[str]] = {}
        for alias, key in self._db.execute("SELECT object_key, subject_key FROM triples WHERE relation = 'alt_name'"):
            self.aliases.setdefault(alias, set()).add(key)
        self.size = self._db.execute("SELECT count(*) FROM triples").fetchone()[0]
        self._names = [(k, (k,)) for k in self.entities] + [(a, tuple(ks)) for a, ks in self.aliases.items()]
        self._by_pair: dict[str, list[str]] = {}  # letter pair -> entity keys containing it
        for key in self.entities:
            for pair in _pairs(key):
                self._by_pair.setdefault(pair, []).append(key)

    @classmethod
    def build(cls, path: str | Path, triples: list[Triple] | None = None) -> KGStore:
        """Write triples (by default the country facts with inverse edges) to `path` atomically."""
        triples = country_triples(inverse=True) if triples is None else triples

        def fill(db: sqlite3.Connection) -> None:
            db.executescript("""
                CREATE TABLE triples(subject TEXT NOT NULL, subject_key TEXT NOT NULL, relation TEXT NOT NULL,
                    object TEXT NOT NULL, object_key TEXT NOT NULL, subject_type TEXT, object_type TEXT);
                CREATE TABLE meta(version TEXT);
            """)
            db.executemany(
                "INSERT INTO triples VALUES (?, ?, ?, ?, ?, ?, ?)",
                ((t.subject, entity_key(t.subject), t.relation, t.object, entity_key(t.object),
                  t.subject_type, t.object_type) for t in triples),
            )
            db.executescript(f"""
                CREATE INDEX triples_by_subject ON triples(subject_key, relation);
                CREATE TABLE entities(key TEXT PRIMARY KEY, name TEXT, types TEXT, facts INTEGER) WITHOUT ROWID;
                INSERT INTO entities SELECT subject_key, min(subject), group_concat(DISTINCT subject_type), count(*)
                    FROM triples GROUP BY subject_key;
                INSERT INTO meta VALUES ('{SCHEMA_VERSION}');
            """)

        return cls(write_atomically(path, fill))

    @classmethod
    def open_or_build(cls, path: str | Path = DEFAULT_DB) -> KGStore:
        path = Path(path).expanduser()
        return cls(path) if path.exists() else cls.build(path)

    def close(self) -> None:
        self._db.close()

    # --- lookup helpers ---

    def _label(self, key: str) -> str:
        name, types, _ = self.entities[key]
        return f"{name} [{', '.join(types)}]"

    def _closest(self, key: str, n: int = 5) -> list[str]:
        """Close names by difflib, compared only with names sharing two letter pairs (far faster than comparing all)."""
        shared = Counter(k for pair in _pairs(key) for k in self._by_pair.get(pair, ()))
        candidates = [k for k, m in shared.items() if m >= min(2, len(key) - 1)]
        return difflib.get_close_matches(key, candidates, n=n, cutoff=0.6)

    def _resolve(self, entity: str) -> str:
        """Entity key for a name or alias, or a 404 that names the closest entities."""
        key = entity_key(entity)
        if key in self.entities:
            return key
        if len(owners := self.aliases.get(key, set())) == 1:
            return next(iter(owners))
        close = sorted(owners) or self._closest(key)
        hint = f" Closest names: {', '.join(self._label(k) for k in close)}." if close else ""
        raise KGError(404, f"No entity named {entity!r}.{hint} Search entities by part of the name to find "
                      "the exact one.", suggestions=[self.entities[k][0] for k in close])

    def _relation_counts(self, key: str) -> dict[str, int]:
        rows = self._db.execute(
            "SELECT relation, count(*) FROM triples WHERE subject_key = ? GROUP BY relation ORDER BY relation", (key,)
        )
        return dict(rows.fetchall())

    # --- the three questions the API answers ---

    def _containing(self, key: str) -> list[str]:
        """Entity keys whose name or alias contains `key`: exact matches first, then prefixes, then shortest."""
        rank: dict[str, int] = {}
        for name_key, owners in self._names:
            if key in name_key:
                r = 0 if name_key == key else 1 if name_key.startswith(key) else 2
                rank.update({k: min(rank.get(k, 2), r) for k in owners})
        return sorted(rank, key=lambda k: (rank[k], len(k), k))

    def search_entities(self, name: str, type: str | None = None, limit: int = 10) -> dict[str, Any]:
        key = entity_key(name)
        if not key:
            raise KGError(400, f"name {name!r} has no letters or digits to search for")
        if type is not None and type not in self.types:
            raise KGError(400, f"unknown entity type {type!r}; types are: {', '.join(self.types)}")
        found = self._containing(key)
        hits = [k for k in found if type is None or type in self.entities[k][1]]
        what = f"{type} " if type else ""
        if found and not hits:  # the name exists, just not with that type
            others = ", ".join(self._label(k) for k in found[:5])
            return self._entities_answer(name, type, [], f"No {what}entity matches {name!r}, but these do: {others}.",
                                         matched=False)
        if hits:
            head = f"{len(hits)} {what}{'entity matches' if len(hits) == 1 else 'entities match'} {name!r}"
            head += f" (showing {limit})" if len(hits) > limit else ""
        else:
            hits = [k for k in self._closest(key, n=min(limit, 5)) if type is None or type in self.entities[k][1]]
            head = f"No {what}entity name contains {name!r}; the closest names are"
        if not hits:
            msg = (f"No {what}entity name contains {name!r} and none is close. Entity types: "
                   f"{', '.join(self.types)}. Try a shorter part of the name, or a country such as 'France'.")
            return self._entities_answer(name, type, [], msg, matched=False)
        hits = hits[:limit]
        lines = [f"- {self._label(k)}: {self.entities[k][2]} fact{'s' * (self.entities[k][2] > 1)}" for k in hits]
        msg = f"{head}:\n" + "\n".join(lines) + "\nAsk for the relations of one of these names to see what is known."
        return self._entities_answer(name, type, hits, msg, matched=bool(found))

    def _entities_answer(self, name: str, type: str | None, keys: list[str], message: str,
                         matched: bool) -> dict[str, Any]:
        entities = [{"name": self.entities[k][0], "types": self.entities[k][1], "facts": self.entities[k][2]}
                    for k in keys]
        return {"name": name, "type": type, "entities": entities, "matched": matched, "message": message}

    def relations(self, entity: str) -> dict[str, Any]:
        key = self._resolve(entity)
        counts = self._relation_counts(key)
        listing = ", ".join(f"{r} ({c})" for r, c in counts.items())
        msg = (f"{self._label(key)} has these relations (number of values): {listing}. "
               "Follow one of them to read its values.")
        return {"entity": self.entities[key][0], "types": self.entities[key][1],
                "relations": [{"relation": r, "count": c} for r, c in counts.items()], "message": msg}

    def follow(self, entity: str, relation: str, limit: int = 50) -> dict[str, Any]:
        key = self._resolve(entity)
        counts = self._relation_counts(key)
        rel = _relation_key(relation)
        rel = next((r for r in (rel, rel.removesuffix("s"), rel + "s") if r in counts), rel)  # languages -> language
        if rel not in counts:
            close = difflib.get_close_matches(rel, list(counts), n=3, cutoff=0.5)
            hint = f" (closest: {', '.join(close)})" if close else ""
            listing = ", ".join(f"{r} ({c})" for r, c in counts.items())
            raise KGError(404, f"{self._label(key)} has no relation {relation!r}{hint}. Its relations are: {listing}.",
                          relations=list(counts))
        rows = self._db.execute(
            "SELECT object, object_type FROM triples WHERE subject_key = ? AND relation = ? ORDER BY object LIMIT ?",
            (key, rel, limit),
        ).fetchall()
        total = counts[rel]
        values = ", ".join(o if t in LITERAL_TYPES else f"{o} [{t}]" for o, t in rows)
        more = f" … and {total - len(rows)} more (ask with a larger limit)" if total > len(rows) else ""
        count = f" ({total} values)" if total > 1 else ""
        return {"entity": self.entities[key][0], "relation": rel, "total": total,
                "objects": [{"name": o, "type": t} for o, t in rows],
                "message": f"{self.entities[key][0]} {rel}{count}: {values}{more}"}


# --- HTTP ---

# endpoint -> {parameter: (type, required)}
_KG_PARAMS: dict[str, dict[str, tuple[type, bool]]] = {
    "entities": {"name": (str, True), "type": (str, False), "limit": (int, False)},
    "relations": {"entity": (str, True)},
    "follow": {"entity": (str, True), "relation": (str, True), "limit": (int, False)},
}
_MAX_INT = {"entities": 100, "relations": 1, "follow": 500}


def kg_app(store: KGStore) -> web.Application:
    """The knowledge-graph API over an open store."""
    listing = "/entities (name, type?, limit?), /relations (entity), /follow (entity, relation, limit?)"
    app = web.Application(middlewares=[json_errors(listing)], client_max_size=64 * 1024)
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kg")  # SQLite and difflib off the loop
    app.on_cleanup.append(lambda _: asyncio.to_thread(worker.shutdown))
    calls: dict[str, Callable[..., Any]] = {"entities": store.search_entities, "relations": store.relations,
                                            "follow": store.follow}

    def endpoint(name: str) -> Callable:
        async def handle(request: web.Request) -> web.Response:
            params = await request_params(request, name, _KG_PARAMS[name], max_int=_MAX_INT[name])
            answer = await asyncio.get_running_loop().run_in_executor(worker, lambda: calls[name](**params))
            return web.json_response(answer)

        return handle

    async def info(_: web.Request) -> web.Response:
        return web.json_response({"service": "agent-rl knowledge graph", "triples": store.size,
                                  "entities": len(store.entities), "types": store.types, "endpoints": listing})

    app.router.add_get("/", info)
    for name in calls:
        app.router.add_route("GET", f"/{name}", endpoint(name))
        app.router.add_route("POST", f"/{name}", endpoint(name))
    return app


async def start_kg_service(db_path: str | Path = DEFAULT_DB, host: str = "127.0.0.1", port: int = 0) -> Service:
    """Serve the knowledge graph at `db_path` (built from countryinfo if missing); port 0 picks a free one."""
    store = await asyncio.wait_for(asyncio.to_thread(KGStore.open_or_build, db_path), 60)
    return await serve(kg_app(store), host, port, store.close)


def kg_serve_cli(host: str, port: int, db_path: str | None) -> int:
    """`agent-rl kg serve`: run the knowledge-graph service until Ctrl-C or SIGTERM, then close it."""

    async def main() -> None:
        stop = asyncio.Event()
        # SIGTERM too (kill, docker stop, systemd): a service started from a script as a background
        # job inherits SIGINT ignored, so Ctrl-C alone would leave no clean way to stop it
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        async with await start_kg_service(db_path or DEFAULT_DB, host, port) as service:
            print(f"knowledge graph at {service.url} (Ctrl-C to stop)", file=sys.stderr, flush=True)
            await stop.wait()  # no deadline on purpose: serve until stopped

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        return 0
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
