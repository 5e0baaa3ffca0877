"""The search index as an HTTP service: `GET /search?q=&k=`, the retrieval service `RemoteSearch` talks to.

Owns: `search_app` and `start_search_service`.
Does not own: the index and its ranking (`tools.search`), the shared service plumbing (`tools.http_service`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

from agent_rl.tools.http_service import Service, json_errors, request_params, serve
from agent_rl.tools.search import SearchIndex, format_hits, query_terms

MAX_HITS = 20


def search_app(index: SearchIndex) -> web.Application:
    """`GET /search?q=&k=` over a search index, answering `{query, terms, hits, message}`."""
    app = web.Application(middlewares=[json_errors("/search (q, k?)")])

    async def search(request: web.Request) -> web.Response:
        params = await request_params(request, "search", {"q": (str, False), "k": (int, False)}, max_chars=4000,
                                      max_int=MAX_HITS)
        q, k = params.get("q", ""), params.get("k", 5)
        terms = query_terms(q)
        hits = await asyncio.to_thread(index.query, terms, k)
        body = {"query": q, "terms": terms, "hits": [h.__dict__ for h in hits], "message": format_hits(q, terms, hits)}
        return web.json_response(body)

    app.router.add_get("/search", search)
    return app


async def start_search_service(index_path: str | Path, host: str = "127.0.0.1", port: int = 0) -> Service:
    """Serve a search index (built if missing) at `/search`, the retrieval service `RemoteSearch` talks to."""
    index = await asyncio.wait_for(asyncio.to_thread(SearchIndex.open_or_build, index_path), 60)
    return await serve(search_app(index), host, port, index.close)
