"""What a run needs of a serving engine, whichever it is: the protocol a backend fills in.

Owns: `ServingBackend` (a sampler over server URLs; the run's servers started, or attached by URL, and stopped on
exit; and the calls to one server that a supervisor and a weight sync make: health, pause and resume generation,
weights reloaded from a folder, LoRA adapters loaded, unloaded and listed, the server's request counters),
`ClientSampler` (the sampler it builds), `Fleet` (the servers a run samples from), `ServerProcess` (a server the
run started and can start again), `ServerError` and `ServerCallError` (one call to one server that failed).
Does not own: any engine's routes or command line (`serving.vllm`: nothing outside it names a vLLM route), which
backend a run uses (`serving.choose`), the sampler protocols (`rollout.sampler`), the order of a push's calls and
what a failed call means for it (`rollout.weight_sync`), when a server is down or restarted (`rollout.supervisor`).

The calls to one server take the caller's aiohttp session (its deadlines are the caller's: a push's, a probe's) and
the server's base URL. Each either does what it says or raises `ServerCallError`, whose message names the server
and the call and quotes the server's reply; `answered` says whether the server answered at all, since a call that
got no answer may be the server's death (the weight sync asks its gate, `rollout.weight_sync.base.Servers`).
docs/serving-backends.md says, method by method, what a second backend (SGLang) would implement.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from agent_rl.core.config import ModelConfig, SamplerConfig
from agent_rl.rollout.sampler import ServedSampler


class ServerError(Exception):
    """The server did not start, died, or does not answer; the message says which and why."""


class ServerCallError(ServerError):
    """One call to one server failed; the message names the server and the call and quotes its reply. `answered`:
    the server answered, and refused (an HTTP error); else no answer came (refused connection, reset, timeout)."""

    def __init__(self, message: str, *, answered: bool):
        super().__init__(message)
        self.answered = answered


class ServerProcess(Protocol):
    """A server the run started and can start again (the supervisor restarts it on its port)."""

    proc: subprocess.Popen | None  # None: not running
    startup_timeout_s: float
    log_path: Path | None

    @property
    def url(self) -> str: ...

    def launch(self) -> Any:
        """Start the process (on the same port as before, after a stop), without waiting for it to answer."""
        ...

    def stop(self) -> None:
        """The process and every process it started gone, within the stop's own deadlines."""
        ...

    def log_tail(self) -> str: ...


@dataclass(frozen=True)
class Fleet:
    """The servers a run samples from: their base URLs and, when the run started them, their processes, one per URL
    in order (None: attached by URL, started and stopped by someone else)."""

    urls: list[str]
    processes: Sequence[ServerProcess] | None = None


class ClientSampler(ServedSampler, Protocol):
    """A served sampler that owns its connections: `async with` closes them."""

    async def __aenter__(self) -> ClientSampler: ...

    async def __aexit__(self, *exc: object) -> None: ...


class ServingBackend(Protocol):
    """What a run needs of a serving engine (module doc). docs/serving-backends.md: each method for SGLang."""

    def serve(self, model: ModelConfig, sampler: SamplerConfig, seed: int, model_dir: str | Path,
              log_path: Path | None = None, tokenizer: str | Path | None = None) -> AbstractContextManager[Fleet]:
        """The run's servers for the model in `model_dir`: `sampler.server_urls` checked (each answers, and reports the
        log-probs of the distribution it samples from at `sampler.temperature`), or `sampler.num_servers` started
        here, sized by the two sections, the i-th seeded `seed + i`, logging beside `log_path`, stopped on exit.
        `tokenizer`: where the tokenizer is when `model_dir` has none (saved weights). ServerError when one does
        not start or does not answer."""
        ...

    def sampler(self, urls: Sequence[str], *, request_timeout_s: float = 300.0) -> ClientSampler:
        """A sampler over the servers at `urls` (their requests spread over them), each request within
        `request_timeout_s`."""
        ...

    async def health(self, http: aiohttp.ClientSession, url: str, timeout_s: float) -> bool:
        """Whether the server answers that it is healthy within `timeout_s` (never raises)."""
        ...

    async def can_reload(self, http: aiohttp.ClientSession, url: str) -> bool:
        """Whether the server can pause and reload its weights in place (what merged and full weights need)."""
        ...

    async def pause(self, http: aiohttp.ClientSession, url: str, *, abort: bool = True) -> None:
        """The server stops generating: with `abort`, every request it runs ends now with the tokens it has sampled
        (finish reason "abort"), else the pause waits for them to finish. Requests that arrive wait."""
        ...

    async def abort_requests(self, http: aiohttp.ClientSession, url: str) -> None:
        """Every request the paused server holds ends now (those that arrived after the pause: no tokens yet)."""
        ...

    async def resume(self, http: aiohttp.ClientSession, url: str) -> None:
        """The paused server generates again, the requests that waited first."""
        ...

    async def load_weights(self, http: aiohttp.ClientSession, url: str, folder: Path) -> None:
        """The (paused) server's weights replaced in place by those saved in `folder`, and its prefix cache dropped:
        cached blocks were computed with the old weights and must not be reused."""
        ...

    async def load_adapter(self, http: aiohttp.ClientSession, url: str, name: str, folder: Path) -> None:
        """The LoRA adapter saved in `folder` served under `name` (requests name it as their model)."""
        ...

    async def unload_adapter(self, http: aiohttp.ClientSession, url: str, name: str) -> None:
        """The adapter `name` no longer served (one the server does not hold is no error: the goal holds)."""
        ...

    async def adapters(self, http: aiohttp.ClientSession, url: str) -> dict[str, str]:
        """The adapters the server holds: name -> the folder it was loaded from."""
        ...

    async def counters(self, http: aiohttp.ClientSession, url: str) -> dict[str, float]:
        """The server's own request counters, summed over its engines: `generation_tokens`, `prefix_cache_queries`
        and `prefix_cache_hits` (tokens since it started) and `requests_running` (now)."""
        ...
