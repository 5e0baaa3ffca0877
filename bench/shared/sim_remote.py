"""The simulated servers for Ray rollout workers: one simulation that every worker reaches, in a process of its own.

Owns: `SimService` (a `SimCluster` in a Ray actor, served over TCP: one line of JSON a request, one a reply),
`SimClient` (a worker's connection to it, with the prefix-cache fingerprints the in-process simulation computes from
the prompt) and `sim_kit` (what each worker plays with: the real calculator environment, the SmolLM2 renderer,
`SimSampler` over a `SimClient`).
Does not own: the server model (`sim_servers`), the workers (`agent_rl.rollout.ray_pool`, used as a run uses them),
what is measured on them (bench/runner_scale.py --workers).

Why TCP: the simulation must be one (every worker's requests queue on the same servers, under one routing rule),
and Ray's own actor calls cost each side a good part of a turn's CPU (docs/performance.md#rollout-workers-on-ray),
more than the runner it measures; a line of JSON over a socket costs tens of microseconds a side.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
from collections import OrderedDict
from typing import Any

import ray

from agent_rl.core.renderers.choose import load_renderer
from agent_rl.learn.models import resolve_model
from agent_rl.rollout.worker import Kit
from bench.shared.sim_episodes import SimSampler, Workload, calculator_env
from bench.shared.sim_servers import GpuModel, SimCluster


class SimService:
    """The simulated servers in a process of their own, reached over TCP (a Ray actor: Ray places and stops it)."""

    async def start(self, servers: int, gpu: dict[str, Any], routing: str, shared: int) -> tuple[str, int]:
        """Start the cluster and listen; returns (host, port) for the workers."""
        self.cluster = SimCluster(servers, GpuModel(**gpu), routing, shared)
        self.server = await asyncio.start_server(self._serve, "0.0.0.0", 0, limit=2**20)
        return ray.util.get_node_ip_address(), self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def one(rid: int, conv: str, prompt: int, out: int, prints: list[list[int]], tail: int) -> None:
            known = dict((k, fp) for k, fp in prints)
            await self.cluster.generate(conv, prompt, out, check=known.get, tail=tail)
            writer.write(b"%d\n" % rid)

        pending: set[asyncio.Task[None]] = set()
        while line := await reader.readline():
            task = asyncio.ensure_future(one(*json.loads(line)))
            pending.add(task)
            task.add_done_callback(pending.discard)

    async def snapshot(self) -> tuple[tuple[int, int, int, int], float]:
        """(requests, output tokens, prefilled, prompt tokens) so far, and the process's CPU seconds."""
        return self.cluster.snapshot(), time.process_time()


class SimClient:
    """A worker's connection to `SimService`, with `SimCluster.generate`'s signature (`SimSampler` calls it as it
    calls the in-process cluster). A conversation is named by the process and the
    sampler's key; the prefix check is sent as the fingerprints of the prompt at each length the conversation's
    earlier turns ended at (the only lengths a server's cache can hold for it)."""

    def __init__(self, address: tuple[str, int]):
        self.address, self.pid = address, os.getpid()
        self.waiting: dict[int, asyncio.Future[None]] = {}
        self.ends: OrderedDict[str, list[int]] = OrderedDict()  # conversation -> where its turns ended
        self.next_id, self.writer = 0, None
        self.lock = asyncio.Lock()

    async def _connect(self) -> asyncio.StreamWriter:
        async with self.lock:
            if self.writer is None:
                reader, self.writer = await asyncio.open_connection(*self.address, limit=2**20)
                asyncio.ensure_future(self._replies(reader))
            return self.writer

    async def _replies(self, reader: asyncio.StreamReader) -> None:
        while line := await reader.readline():
            future = self.waiting.pop(int(line), None)
            if future is not None and not future.done():
                future.set_result(None)

    async def generate(self, conv: Any, prompt_len: int, out_len: int, check: Any = None, tail: int = 0) -> None:
        writer = await self._connect()
        key = f"{self.pid}:{conv}"
        ends = self.ends.pop(key, [])
        prints = [[k, check(k)] for k in ends if k <= prompt_len] if check is not None else []
        rid, self.next_id = self.next_id, self.next_id + 1
        self.waiting[rid] = asyncio.get_running_loop().create_future()
        writer.write(json.dumps([rid, key, prompt_len, out_len, prints, tail]).encode() + b"\n")
        try:
            await asyncio.wait_for(self.waiting[rid], 600)
        finally:
            self.waiting.pop(rid, None)
        self.ends[key] = [*ends, prompt_len + out_len]
        if len(self.ends) > 100_000:
            self.ends.popitem(last=False)


def sim_kit(address: tuple[str, int], model: str, work: dict[str, Any]) -> Kit:
    """A worker's kit: the calculator environment (its calculator where `Workload.calculator` says), the renderer,
    `SimSampler` over the shared simulation."""
    renderer = load_renderer(resolve_model(model))
    shape = Workload(**work)
    return Kit(functools.partial(calculator_env, where=shape.calculator), renderer,
               SimSampler(SimClient(address), renderer, shape, seed=os.getpid()))
