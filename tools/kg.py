"""The agent-facing knowledge-graph tools: a client of the HTTP service in `tools.kg_service`.

Owns: `KGClient`, which holds one aiohttp session (use it as an async context manager) and exposes
`search_entities`, `get_relations` and `follow` as typed methods returning the text the model reads;
`tools()` wraps them as `Tool`s. Every request has a deadline; connection failures, timeouts and
4xx answers become `ToolError` with the service's explanation (closest names, existing relations).
Does not own: the data, the store or the server (`tools.kg_service`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from agent_rl.core.http import SessionOwner
from tools.base import Tool, ToolError


class KGClient(SessionOwner):
    """Knowledge-graph tools over a running service at `url`."""

    def __init__(self, url: str, timeout_s: float = 10.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    def tools(self) -> list[Tool]:
        return [Tool(self.search_entities), Tool(self.get_relations), Tool(self.follow)]

    async def _ask(self, endpoint: str, payload: dict[str, Any]) -> str:
        try:
            async with self.http().post(f"{self.url}/{endpoint}", json=payload) as resp:
                body = await resp.json(content_type=None)
        except (asyncio.TimeoutError, TimeoutError):
            raise ToolError(f"the knowledge graph at {self.url} did not answer within {self.timeout_s:g} s") from None
        except (aiohttp.ClientError, ValueError) as e:
            raise ToolError(f"the knowledge graph at {self.url} is unreachable ({type(e).__name__}: {e})") from None
        if resp.status != 200 or not isinstance(body, dict) or "message" not in body:
            error = body.get("error", body) if isinstance(body, dict) else body
            raise ToolError(str(error) if resp.status < 500 else f"knowledge graph error {resp.status}: {error}")
        return body["message"]

    async def search_entities(self, name: str, entity_type: str = "") -> str:
        """Find entities in the knowledge graph of countries whose name contains `name` (or is close to it).

        Args:
            name: part of an entity name, e.g. "Fran" or "Buenos".
            entity_type: optional type filter: country, city, region, subregion, language, currency or province.
        """
        payload = {"name": name} | ({"type": entity_type.strip().lower()} if entity_type.strip() else {})
        return await self._ask("entities", payload)

    async def get_relations(self, entity: str) -> str:
        """List the relations an entity has in the knowledge graph (e.g. capital, borders, language).

        Args:
            entity: the entity's name, e.g. "France".
        """
        return await self._ask("relations", {"entity": entity})

    async def follow(self, entity: str, relation: str) -> str:
        """Read the values of one relation of an entity, e.g. follow("France", "capital") -> Paris.

        Args:
            entity: the entity's name, e.g. "France".
            relation: a relation listed by get_relations, e.g. "capital", "borders" or "capital_of".
        """
        return await self._ask("follow", {"entity": entity, "relation": relation})
