"""Full-text search over the country articles: an SQLite FTS5 index ranked by BM25, and the search tool.

Owns: building and reopening the index file (`SearchIndex`), turning any text a model writes into
safe FTS5 terms (`query_terms`), the model-readable result text (`format_hits`), the two tool
backends with one `search(query, k)` method each (`LocalSearch` over a file, `RemoteSearch` over
HTTP) and `search_cli`.
Does not own: the article text (`tools.countries`) or the HTTP server that serves an index at
`/search` (`tools.search_service.start_search_service`).

Queries are never handed to FTS5 as syntax: words are pulled out with a regex, quoted one by one
and OR-ed, so quotes, operators and brackets in the model's text cannot raise, and BM25 ranks
articles by how many rare words they match.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from agent_rl.core.http import SessionOwner
from agent_rl.tools.base import ToolError
from agent_rl.tools.sqlite_files import open_versioned, write_atomically

DEFAULT_INDEX = Path("~/.cache/agent-rl/countries-fts.sqlite")
SCHEMA_VERSION = "countries-fts-1"
QUERY_DEADLINE_S = 10.0
MAX_K = 20
MAX_TERMS = 32
_STOPWORDS = frozenset(
    "a an and are as at be by does for from has have how in is it its of on or the to was what "
    "when where which who whose why with".split()
)


@dataclass(frozen=True)
class Hit:
    title: str
    snippet: str  # matched words wrapped in ** **
    score: float  # BM25, higher is better


def query_terms(text: str) -> list[str]:
    """The searchable words of free text: lower-cased, stop words dropped unless nothing else is left."""
    words = [w.lower()[:64] for w in re.findall(r"[^\W_]+", text)]
    content = [w for w in words if w not in _STOPWORDS]
    return list(dict.fromkeys(content or words))[:MAX_TERMS]


def _check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise ToolError(f"k must be an integer from 1 to {MAX_K}, got {k!r}")


class SearchIndex:
    """An FTS5 file with one row per article; read-only once built, safe to share across threads."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._db, (_, self.size) = open_versioned(self.path, SCHEMA_VERSION, "search index", "SearchIndex.build",
                                                  meta_columns="version, articles")

    @classmethod
    def build(cls, path: str | Path, articles: Sequence[tuple[str, str]] | None = None) -> SearchIndex:
        """Write (title, text) articles, by default the country corpus, to `path` atomically."""
        if articles is None:
            from agent_rl.tools.countries import country_articles

            articles = country_articles()
        rows = list(articles)

        def fill(db: sqlite3.Connection) -> None:
            db.execute("CREATE VIRTUAL TABLE articles USING fts5(title, body, "
                       "tokenize='unicode61 remove_diacritics 2')")
            db.executemany("INSERT INTO articles(title, body) VALUES (?, ?)", rows)
            db.execute("INSERT INTO articles(articles) VALUES ('optimize')")
            db.execute("CREATE TABLE meta(version TEXT, articles INTEGER)")
            db.execute("INSERT INTO meta VALUES (?, ?)", (SCHEMA_VERSION, len(rows)))

        return cls(write_atomically(path, fill))

    @classmethod
    def open_or_build(cls, path: str | Path = DEFAULT_INDEX) -> SearchIndex:
        path = Path(path).expanduser()
        return cls(path) if path.exists() else cls.build(path)

    def query(self, terms: list[str], k: int = 5) -> list[Hit]:
        """Top-k articles for already-sanitised terms (see `query_terms`), best first."""
        if not terms:
            return []
        match = " OR ".join('"' + t.replace('"', '""') + '"' for t in terms)
        rows = self._db.execute(
            "SELECT title, snippet(articles, 1, '**', '**', '…', 24), -bm25(articles, 5.0, 1.0) "
            "FROM articles WHERE articles MATCH ? ORDER BY bm25(articles, 5.0, 1.0) LIMIT ?",
            (match, k),
        ).fetchall()
        return [Hit(title, snippet, round(score, 4)) for title, snippet, score in rows]

    def close(self) -> None:
        self._db.close()


def format_hits(query: str, terms: list[str], hits: list[Hit]) -> str:
    """What the model reads: titled snippets, or what to try when nothing matched."""
    if not terms:
        return (f"The query {query!r} has no searchable words. "
                "Search with a few plain keywords, for example: capital of France.")
    if not hits:
        return (f"No article matches {query!r} (searched for: {', '.join(terms)}). "
                "Try fewer or different keywords, such as a country, city or language name.")
    lines = [f"Top {len(hits)} results for {query!r}:"]
    for i, hit in enumerate(hits, 1):
        lines.append(f"[{i}] {hit.title}\n{hit.snippet}")
    return "\n".join(lines)


class _SearchTool:
    """The agent-facing `search` tool; subclasses only say where the hits come from."""

    async def search(self, query: str, k: int = 5) -> str:
        """Search the encyclopedia of countries and return the best matching articles with snippets.

        Args:
            query: a few keywords, for example "capital Paris" or "landlocked country in Africa".
            k: how many articles to return (1 to 20).
        """
        _check_k(k)
        terms = query_terms(query)
        return format_hits(query, terms, await self._hits(terms, k))

    async def _hits(self, terms: list[str], k: int) -> list[Hit]:
        raise NotImplementedError


class LocalSearch(_SearchTool):
    """The search tool over an index file on this machine."""

    def __init__(self, index: SearchIndex):
        self.index = index

    async def _hits(self, terms: list[str], k: int) -> list[Hit]:
        return await asyncio.wait_for(asyncio.to_thread(self.index.query, terms, k), QUERY_DEADLINE_S)


class RemoteSearch(SessionOwner, _SearchTool):
    """The same search tool, answered by a retrieval service (`GET {url}/search?q=TERMS&k=`, JSON hits)."""

    def __init__(self, url: str, timeout_s: float = 10.0):
        self.url = url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def _hits(self, terms: list[str], k: int) -> list[Hit]:
        # the cleaned terms are sent instead of the raw text, so any query fits in a URL
        try:
            async with self.http().get(f"{self.url}/search", params={"q": " ".join(terms), "k": str(k)}) as resp:
                body = await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            raise ToolError(f"search service at {self.url} failed: {type(e).__name__} {e}".strip()) from None
        if resp.status != 200 or not isinstance(body, dict) or "hits" not in body:
            error = body.get("error", body) if isinstance(body, dict) else body
            raise ToolError(f"search service answered {resp.status}: {error}"[:500])
        return [Hit(**hit) for hit in body["hits"]]


def search_cli(text: str, k: int, index_path: str | None) -> int:
    """`agent-rl search query TEXT`: print the top-k results, building the index on first use."""
    path = Path(index_path or DEFAULT_INDEX).expanduser()
    try:
        _check_k(k)
        if not path.exists():
            start = time.perf_counter()
            SearchIndex.build(path)
            print(f"built search index {path} in {time.perf_counter() - start:.2f} s", file=sys.stderr)
        index = SearchIndex(path)
    except (ToolError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    terms = query_terms(text)
    print(format_hits(text, terms, index.query(terms, k)))
    index.close()
    return 0
