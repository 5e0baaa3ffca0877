"""The supervisor's gate as a rollout worker sees it (`rollout.workers: N`): which servers take requests, mirrored
from rank 0, and the question a worker cannot answer alone (is the server whose call just failed down?).

Owns: `GateState` (rank 0's servers, those down, and the line the run stops with once one cannot be mended: what
rank 0 sends every worker, inside `rollout.worker.ServedState`), `WatchedGate` (what rank 0's gate offers besides
routing: its state, and a call on each change; `rollout.supervisor.Supervisor`), `MirrorGate` (a worker's
`rollout.sampler.ServerGate` over the last `GateState` it took: its sampler routes by it and waits by it, and a
call that failed at the connection becomes a question to rank 0, whose answer says whether to raise `ServerLost`).
Does not own: deciding that a server is down, restarting it, restoring its weights (`rollout.supervisor`, on rank
0), carrying states, questions and answers between rank 0 and the workers (`rollout.workers`, `rollout.ray_pool`,
`rollout.worker`), the replay of a lost episode (`rollout.stream`).

Why a worker asks rather than decides: a server is down when rank 0's supervisor says so (it watches the process
and its health, and only it restarts and restores), and a worker's verdict of its own (say, a health probe) could
disagree with it: a worker that cannot reach a server rank 0 sees as up would replay the same episodes for ever,
free of `rollout.on_error`'s budget. So a worker says `ServerLost` only once rank 0 has marked the server down,
and routes to a server again only once rank 0 has restored it (the state that says "up" is sent after `restore`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from agent_rl.rollout.sampler import SamplerError, ServerGate

ANSWER_WAIT_S = 30.0  # a question's deadline: rank 0 answers within the supervisor's own (2 s for a started server,
#                       its health probe's for an attached one); past it the failure stands as the call's own


@dataclass(frozen=True)
class GateState:
    """Rank 0's servers (base URLs), the ones down (restarting, or an attached one waited for), and, once one
    cannot be mended, the line the run stops with ("" until then)."""

    servers: tuple[str, ...] = ()
    down: frozenset[str] = field(default_factory=frozenset)
    failure: str = ""

    @property
    def some_up(self) -> bool:
        return any(url not in self.down for url in self.servers)


@runtime_checkable
class WatchedGate(ServerGate, Protocol):
    """Rank 0's gate, as the workers' sampler forwards it (`rollout.supervisor.Supervisor`)."""

    def state(self) -> GateState: ...

    def listen(self, changed: Callable[[], None]) -> Callable[[], None]:
        """Call `changed()` whenever a server goes down or comes back (or the run cannot go on); returns the call
        that stops it."""
        ...


class MirrorGate:
    """A worker's gate: the last `GateState` rank 0 sent (`adopt`), and the questions it has not yet answered.
    `ask()` wakes whoever carries questions to rank 0 (`rollout.worker.RolloutWorker.results`)."""

    def __init__(self, ask: Callable[[], None]):
        self.state = GateState()
        self._ask = ask
        self._answers: dict[str, asyncio.Future[bool]] = {}  # url -> rank 0's answer, not yet had
        self._unsent: list[str] = []
        self._changed = asyncio.Event()  # replaced at each state: every waiter of the old one wakes

    def adopt(self, state: GateState) -> None:
        self.state = state
        self._changed.set()
        self._changed = asyncio.Event()
        for url in [u for u in self._answers if u in state.down]:  # down already: no answer needed
            self.answer(url, True)

    def is_up(self, url: str) -> bool:
        return url.rstrip("/") not in self.state.down

    async def wait_up(self, timeout_s: float) -> None:
        """Until rank 0 says some server is up; SamplerError past `timeout_s`, or at once when the run is stopping."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.state.some_up:
            if self.state.failure:
                raise SamplerError(self.state.failure)
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise SamplerError(f"no vLLM server was up within {timeout_s:g} s (sampler.request_timeout_s); "
                                   f"down: {', '.join(self.state.servers)}") from None

    async def lost(self, url: str) -> bool:
        """A call to `url` failed at the connection: whether rank 0 says its server is down (asking it begins the
        server's mending there). Concurrent failures on one server share one question."""
        url = url.rstrip("/")
        if url in self.state.down:
            return True
        answer = self._answers.get(url)
        if answer is None:
            answer = self._answers[url] = asyncio.get_running_loop().create_future()
            self._unsent.append(url)
            self._ask()
        try:
            return await asyncio.wait_for(asyncio.shield(answer), ANSWER_WAIT_S)
        except TimeoutError:
            self._answers.pop(url, None)
            return False  # rank 0 did not say: retried as the call's own failure, as an unsupervised one is

    @property
    def asking(self) -> bool:
        return bool(self._unsent)

    def questions(self) -> list[str]:
        """The servers to ask rank 0 about, each once."""
        out, self._unsent = self._unsent, []
        return out

    def answer(self, url: str, down: bool) -> None:
        answer = self._answers.pop(url, None)
        if answer is not None and not answer.done():
            answer.set_result(down)
