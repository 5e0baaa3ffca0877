"""Environments whose tools come from MCP servers: `MCPEnv`, a thin `ToolEnv`.

Owns: `MCPEnv`: connecting to one or more MCP servers (stdio commands or streamable-HTTP URLs) when
the episode is entered, exposing their listed tools (plus any local typed Python functions) as the
episode's tools, and closing what the episode opened.
Does not own: the MCP client, deadlines and error messages (`tools.mcp`), the episode's task,
prompt and reward (a subclass writes `initial_messages` and `reward`, as for any `ToolEnv`).

Connections: with `shared=True` (the default) the episodes of a process share one connection per
server, started by the first episode (see `tools.mcp` for the cost that decided this); with
`shared=False` each episode opens its own and closes it on leaving: a stdio server process per
episode, for servers that keep state per session. A server that cannot start makes entering the
episode raise `MCPStartError` (one line naming the server); the runner records that as the
episode's error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from agent_rl.envs.base import ToolEnv
from agent_rl.tools.mcp import (
    MCPConnection,
    MCPServerSpec,
    connect,
    mcp_server,
    shared_connection,
)

ServerLike = MCPServerSpec | str | Sequence[str]


class MCPEnv(ToolEnv):
    """One episode whose tools are the listed tools of `servers`, then the local `tools`.

    The tool list is known only once the episode is entered (`async with`): the servers say what
    they have. Tool names must be unique across servers and local tools.
    """

    def __init__(self, servers: Sequence[ServerLike], tools: Sequence[Callable[..., Any]] = (),
                 shared: bool = True, max_parallel_calls: int = 8):
        self.servers = [mcp_server(s) for s in servers]
        self.shared = shared
        self._owned: list[MCPConnection] = []
        self._max_parallel_calls = max_parallel_calls
        super().__init__(tools, max_parallel_calls=max_parallel_calls)
        self._local = list(self.tools)  # wrapped once; the servers' tools join them on entering

    async def __aenter__(self) -> MCPEnv:
        try:  # every start runs to its end (return_exceptions) so that close() sees all it opened
            opened = await asyncio.gather(*(self._open(s) for s in self.servers), return_exceptions=True)
            failed = [e for e in opened if isinstance(e, BaseException)]
            if failed:
                raise failed[0]
            remote = [tool for conn in opened if not isinstance(conn, BaseException) for tool in conn.tools]
            # tool names must be unique across servers and local tools (ValueError otherwise)
            super().__init__([*self._local, *remote], max_parallel_calls=self._max_parallel_calls)
        except BaseException:  # a failed start, a name clash, or a cancelled episode
            await self.close()
            raise
        return self

    async def _open(self, spec: MCPServerSpec) -> MCPConnection:
        if self.shared:
            return await shared_connection(spec)
        conn = await connect(spec)
        self._owned.append(conn)
        return conn

    async def close(self) -> None:
        """Close the connections this episode opened (shared ones stay for the next episode)."""
        owned, self._owned = self._owned, []
        await asyncio.gather(*(conn.aclose() for conn in owned))
