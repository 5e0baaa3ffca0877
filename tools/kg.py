"""The agent-facing knowledge-graph tools: a client of the HTTP service in `tools.kg_service`.

Owns: `KGClient`, which holds one aiohttp session (use it as an async context manager) and exposes
`search_entities`, `get_relations` and `follow` as typed methods returning the text the model reads;
`tools()` wraps them as `Tool`s. Every request has a deadline; connection failures, timeouts and
4xx answers become `ToolError` with the service's explanation (closest names, existing relations).
Does not own: the data, the store or the server (`tools.kg_service`).

`empty_results`: what an empty lookup gives the model. "explain" (the default) passes the service's
explanation on (an error naming the closest entities or the relations that exist; a search listing
only close names says so). "bare" answers such a lookup with a plain `[]`, as many real APIs do: a
successful call with nothing in it. Found results read the same in both modes; bad requests (400)
and infrastructure failures stay errors. The bare mode exists to measure what explanations are worth
(`examples/collapse_study.py`): it is never the better choice for training.
"""

from __future__ import annotations

from typing import Any, Literal

import aiohttp

from agent_rl.core.http import SessionOwner
from agent_rl.tools.base import Tool, ToolError

EMPTY_RESULTS = ("explain", "bare")
BARE_EMPTY = "[]"


def _empty(status: int, body: Any) -> bool:
    """An empty lookup: no such entity (404 with suggestions) or relation (404 with the relations that
    exist), or a search whose listing holds only close names (matched false)."""
    if not isinstance(body, dict):
        return False
    return (status == 404 and ("suggestions" in body or "relations" in body)) or \
        (status == 200 and body.get("matched") is False)


class KGClient(SessionOwner):
    """Knowledge-graph tools over a running service at `url`."""

    def __init__(self, url: str, timeout_s: float = 10.0, empty_results: Literal["explain", "bare"] = "explain"):
        if empty_results not in EMPTY_RESULTS:
            raise ValueError(f"empty_results must be one of {', '.join(EMPTY_RESULTS)} (got {empty_results!r})")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.empty_results = empty_results
        self.empty_lookups = 0  # lookups that found nothing, whatever the mode told the model
        self.empty_answers = 0  # of those, the ones answered as a result (not as a tool error)

    def tools(self) -> list[Tool]:
        return [Tool(self.search_entities), Tool(self.get_relations), Tool(self.follow)]

    async def _ask(self, endpoint: str, payload: dict[str, Any]) -> str:
        try:
            async with self.http().post(f"{self.url}/{endpoint}", json=payload) as resp:
                body = await resp.json(content_type=None)
        except TimeoutError:
            raise ToolError(f"the knowledge graph at {self.url} did not answer within {self.timeout_s:g} s") from None
        except (aiohttp.ClientError, ValueError) as e:
            raise ToolError(f"the knowledge graph at {self.url} is unreachable ({type(e).__name__}: {e})") from None
        empty = _empty(resp.status, body)
        self.empty_lookups += empty
        if empty and self.empty_results == "bare":
            self.empty_answers += 1
            return BARE_EMPTY
        if resp.status != 200 or not isinstance(body, dict) or "message" not in body:
            error = body.get("error", body) if isinstance(body, dict) else body
            raise ToolError(str(error) if resp.status < 500 else f"knowledge graph error {resp.status}: {error}")
        self.empty_answers += empty
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
