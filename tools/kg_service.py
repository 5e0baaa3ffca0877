"""HTTP services over local data: the knowledge-graph API (and a `/search` endpoint for a search index).

Owns: the triple store in SQLite (`KGStore`: build once, reopen read-only; entity lookup by exact,
alias, substring and fuzzy name), the aiohttp apps with their JSON error handling, the running-service
handle (`Service`, from `start_kg_service` / `start_search_service`) and `kg_serve_cli`.
Does not own: the facts themselves (`tools.countries`), the search index (`tools.search`) or the
agent-facing clients (`tools.kg.KGClient`, `tools.search.RemoteSearch`).

Endpoints (GET with query parameters, or POST with a JSON object; JSON out):
  /entities  name, type?, limit?    entities whose name contains `name`, else the closest names
  /relations entity                 the relations an entity has, with how many values each
  /follow    entity, relation, limit?  the values of one relation
  /search    q, k?                  (search service only) top-k articles
Every answer carries a `message` written for a language model; an empty result says what was asked
and what exists nearby, never a bare `[]`. Bad requests get 4xx and `{"error": "..."}`.
"""

from __future__ import annotations

import asyncio
import difflib
import re
import signal
import sqlite3
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from aiohttp import web

from tools.countries import LITERAL_TYPES, Triple, country_triples, entity_key
from tools.search import SearchIndex, format_hits, query_terms
from tools.sqlite_files import open_versioned, write_atomically

DEFAULT_DB = Path("~/.cache/agent-rl/countries-kg.sqlite")
SCHEMA_VERSION = "countries-kg-1"
REQUEST_DEADLINE_S = 10.0


class KGError(Exception):
    """A request the store cannot answer; `status` is the HTTP status, `message` says how to recover."""

    def __init__(self, status: int, message: str, **extra: Any):
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


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
        """Close names by difflib, compared only with names sharing two letter pairs (10x faster than all)."""
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
            return self._entities_answer(name, type, [], f"No {what}entity matches {name!r}, but these do: {others}.")
        if hits:
            head = f"{len(hits)} {what}{'entity matches' if len(hits) == 1 else 'entities match'} {name!r}"
            head += f" (showing {limit})" if len(hits) > limit else ""
        else:
            hits = [k for k in self._closest(key, n=min(limit, 5)) if type is None or type in self.entities[k][1]]
            head = f"No {what}entity name contains {name!r}; the closest names are"
        if not hits:
            msg = (f"No {what}entity name contains {name!r} and none is close. Entity types: "
                   f"{', '.join(self.types)}. Try a shorter part of the name, or a country such as 'France'.")
            return self._entities_answer(name, type, [], msg)
        hits = hits[:limit]
        lines = [f"- {self._label(k)}: {self.entities[k][2]} fact{'s' * (self.entities[k][2] > 1)}" for k in hits]
        msg = f"{head}:\n" + "\n".join(lines) + "\nAsk for the relations of one of these names to see what is known."
        return self._entities_answer(name, type, hits, msg)

    def _entities_answer(self, name: str, type: str | None, keys: list[str], message: str) -> dict[str, Any]:
        entities = [{"name": self.entities[k][0], "types": self.entities[k][1], "facts": self.entities[k][2]}
                    for k in keys]
        return {"name": name, "type": type, "entities": entities, "message": message}

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
_LIMITS = {"entities": 100, "follow": 500, "search": 20}


async def _params(
    request: web.Request, endpoint: str, spec: dict[str, tuple[type, bool]], max_chars: int = 200
) -> dict[str, Any]:
    """Validated parameters from the query string (GET) or a JSON object body (POST); 400 with a reason."""
    if request.method == "POST":
        try:
            raw = await request.json()
        except ValueError:
            raise KGError(400, f"/{endpoint}: the body is not valid JSON") from None
        if not isinstance(raw, dict):
            raise KGError(400, f"/{endpoint}: the body must be a JSON object, got {type(raw).__name__}")
    else:
        raw = dict(request.query)
    expected = ", ".join(f"{p}{'' if req else '?'}" for p, (_, req) in spec.items())
    if unknown := sorted(set(raw) - set(spec)):
        raise KGError(400, f"/{endpoint}: unknown parameter {unknown[0]!r}; expected: {expected}")
    out: dict[str, Any] = {}
    for name, (kind, required) in spec.items():
        value = raw.get(name)
        if value is None or value == "":
            if required:
                raise KGError(400, f"/{endpoint}: missing parameter {name!r}; expected: {expected}")
            continue
        if kind is int and isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
            value = int(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise KGError(400, f"/{endpoint}: parameter {name!r} must be {kind.__name__}, got {value!r}"[:300])
        if kind is str and len(value) > max_chars:
            raise KGError(400, f"/{endpoint}: parameter {name!r} is longer than {max_chars} characters")
        if kind is int and not 1 <= value <= _LIMITS[endpoint]:
            raise KGError(400, f"/{endpoint}: parameter {name!r} must be from 1 to {_LIMITS[endpoint]}, got {value}")
        out[name] = value
    return out


def _json_errors(endpoints: str) -> Callable:
    """Middleware: a deadline on every request; every failure leaves as `{"error": ...}` JSON, 4xx/5xx."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            async with asyncio.timeout(REQUEST_DEADLINE_S):
                return await handler(request)
        except KGError as e:
            return web.json_response({"error": e.message, **e.extra}, status=e.status)
        except web.HTTPNotFound:
            return web.json_response({"error": f"unknown endpoint {request.path}; endpoints: {endpoints}"}, status=404)
        except web.HTTPMethodNotAllowed:
            msg = f"method {request.method} not allowed on {request.path}; use GET or POST"
            return web.json_response({"error": msg}, status=405)
        except web.HTTPException as e:
            return web.json_response({"error": f"{e.status} {e.reason}: {e.text or ''}".strip()}, status=e.status)
        except (asyncio.TimeoutError, TimeoutError):
            return web.json_response({"error": f"{request.path} took longer than {REQUEST_DEADLINE_S:g} s"}, status=503)

    return middleware


def kg_app(store: KGStore) -> web.Application:
    """The knowledge-graph API over an open store."""
    listing = "/entities (name, type?, limit?), /relations (entity), /follow (entity, relation, limit?)"
    app = web.Application(middlewares=[_json_errors(listing)], client_max_size=64 * 1024)
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kg")  # SQLite and difflib off the loop
    app.on_cleanup.append(lambda _: asyncio.to_thread(worker.shutdown))
    calls = {"entities": store.search_entities, "relations": store.relations, "follow": store.follow}

    def endpoint(name: str) -> Callable:
        async def handle(request: web.Request) -> web.Response:
            params = await _params(request, name, _KG_PARAMS[name])
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


def search_app(index: SearchIndex) -> web.Application:
    """`GET /search?q=&k=` over a search index, answering `{query, terms, hits, message}`."""
    app = web.Application(middlewares=[_json_errors("/search (q, k?)")])

    async def search(request: web.Request) -> web.Response:
        params = await _params(request, "search", {"q": (str, False), "k": (int, False)}, max_chars=4000)
        q, k = params.get("q", ""), params.get("k", 5)
        terms = query_terms(q)
        hits = await asyncio.to_thread(index.query, terms, k)
        body = {"query": q, "terms": terms, "hits": [h.__dict__ for h in hits], "message": format_hits(q, terms, hits)}
        return web.json_response(body)

    app.router.add_get("/search", search)
    return app


class Service:
    """A running aiohttp app on a TCP port: `.url`, `await close()`, or `async with`."""

    def __init__(self, runner: web.AppRunner, url: str, on_close: Callable[[], None]):
        self.runner, self.url, self._on_close = runner, url, on_close

    async def close(self) -> None:
        await asyncio.wait_for(self.runner.cleanup(), 30)
        self._on_close()

    async def __aenter__(self) -> Service:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _serve(app: web.Application, host: str, port: int, on_close: Callable[[], None]) -> Service:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5)
    await asyncio.wait_for(runner.setup(), 30)
    try:
        await asyncio.wait_for(web.TCPSite(runner, host, port).start(), 30)
    except BaseException:
        await asyncio.wait_for(runner.cleanup(), 30)
        on_close()
        raise
    bound_host, bound_port = runner.addresses[0][:2]
    host = f"[{bound_host}]" if ":" in bound_host else bound_host
    return Service(runner, f"http://{host}:{bound_port}", on_close)


async def start_kg_service(db_path: str | Path = DEFAULT_DB, host: str = "127.0.0.1", port: int = 0) -> Service:
    """Serve the knowledge graph at `db_path` (built from countryinfo if missing); port 0 picks a free one."""
    store = await asyncio.wait_for(asyncio.to_thread(KGStore.open_or_build, db_path), 60)
    return await _serve(kg_app(store), host, port, store.close)


async def start_search_service(index_path: str | Path, host: str = "127.0.0.1", port: int = 0) -> Service:
    """Serve a search index (built if missing) at `/search`, the retrieval service `RemoteSearch` talks to."""
    index = await asyncio.wait_for(asyncio.to_thread(SearchIndex.open_or_build, index_path), 60)
    return await _serve(search_app(index), host, port, index.close)


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
