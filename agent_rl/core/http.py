"""One aiohttp session owned by a client object: created lazily inside the running loop, closed once.

Owns: `SessionOwner`, the base of every HTTP client here (the vLLM sampler, the KG client, remote
search), so the session lifecycle and `async with` support are written once.
Does not own: requests, retries or error wording (each client's own).
"""

from __future__ import annotations

from typing import Any

import aiohttp


class SessionOwner:
    """Subclasses set `self.timeout` (an aiohttp.ClientTimeout) and call `self.http()` per request."""

    timeout: aiohttp.ClientTimeout
    connector_limit: int = 100  # 0 = unlimited
    _session: aiohttp.ClientSession | None = None

    def http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self.timeout, connector=aiohttp.TCPConnector(limit=self.connector_limit))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
