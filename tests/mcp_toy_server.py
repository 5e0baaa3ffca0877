"""An MCP server written for tests/test_mcp.py, with the official SDK: one tool per way a tool can go.

    python tests/mcp_toy_server.py                  # stdio
    python tests/mcp_toy_server.py --http PORT      # streamable HTTP on 127.0.0.1:PORT/mcp
    python tests/mcp_toy_server.py --fail-start     # dies before serving, with a message on stderr
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")  # plain, not rich
server = MCPServer("toy")
counts = {"calls": 0}  # per server process: tells a shared connection from one per episode


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    counts["calls"] += 1
    return a + b


@server.tool()
def divide(a: float, b: float) -> str:
    """Divide a by b; dividing by zero is an error the caller reads."""
    counts["calls"] += 1
    if b == 0:
        raise ToolError("cannot divide by zero")
    return f"{a / b:g}"


@server.tool()
def buggy() -> str:
    """A tool with a bug: raises an exception the server did not mean to show."""
    raise KeyError("secret")


@server.tool()
async def sleep(seconds: float) -> str:
    """Sleep, then say so."""
    await asyncio.sleep(seconds)
    return f"slept {seconds:g} s"


@server.tool()
def whoami() -> str:
    """This server process's id and how many add/divide calls it has served."""
    return f"pid={os.getpid()} calls={counts['calls']}"


@server.tool()
def crash() -> str:
    """Exit the server process at once, mid-call."""
    print("toy server: crashing on purpose", file=sys.stderr, flush=True)
    os._exit(3)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, default=None, metavar="PORT")
    parser.add_argument("--fail-start", action="store_true")
    args = parser.parse_args()
    if args.fail_start:
        sys.exit("toy server: no configuration found, giving up")
    if args.http is not None:
        server.run("streamable-http", host="127.0.0.1", port=args.http)
    else:
        server.run()
