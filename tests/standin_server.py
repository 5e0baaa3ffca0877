"""tests/helpers.py's stand-in vLLM server (`StandInVLLM`) as a process of its own, on a given port, so that a test can
SIGKILL it as an out-of-memory kill ends a real server, and a supervisor (`rollout.supervisor`) can start it again
on the same port. It answers GET /health as vLLM does, and GET /served with how many requests it has completed and the
weights it samples with now (a restarted process starts with weights 1, the stand-in's own, until a restore reloads
the run's).

argv: PORT.
"""

from __future__ import annotations

import asyncio
import sys

from aiohttp import web
from helpers import StandInVLLM


class Served(StandInVLLM):
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def listing(self, request: web.Request) -> web.Response:
        return web.json_response({"served": len(self.served), "weights": self.weights})


async def serve(port: int) -> None:
    server = Served()
    app = web.Application()
    app.router.add_get("/health", server.health)
    app.router.add_get("/served", server.listing)
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/{path:.*}", server.control)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()  # until killed


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1])))
