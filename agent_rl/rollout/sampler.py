"""Samplers as the runner and a weight sync see them: token ids in, sampled token ids + log-probs + the policy
version of each token + finish reason out, whatever engine serves them.

Owns: the `Sampler` protocol (what the runner samples through), `ServedSampler` (a sampler over servers whose
served policy a weight sync switches, and whose requests a push that pauses the servers holds back), the request's
`SamplingParams` and the `Completion` that comes back; `ServerGate`, what a sampler asks of a supervisor (which
servers take requests), `SamplerError`, and `ServerLost`, a request whose server died.
Does not own: speaking to a serving engine (`rollout.serving`: vLLM's client is `serving.vllm.sampler`, built by
the backend's `sampler`), starting, watching and restarting servers (`rollout.serving`, `rollout.supervisor`),
loading adapters or pausing servers (`rollout.weight_sync`), chat rendering (`core.renderers.base`), scripted and
human samplers (`rollout.scripted`, `play`).

Policy versions. Every request names the served policy (`model`: an adapter's versioned name, or "base" for
weights reloaded in place) and is tagged with its version, both read when the request is sent. An adapter
request finishes on its own adapter whatever is pushed meanwhile (`weight_sync.adapter` keeps it loaded).
Weights reloaded in place (merged, full) change under every request, so a push holds the sampler first
(`hold`: new requests wait), aborts what the servers run, and `release`s once the new weights serve: an
aborted request keeps the tokens it sampled, tagged with the old version, and goes on from them under the
new one (`serving.vllm.sampler.VLLMSampler.sample`). So each token's version (`Completion.versions`) is the one
that sampled it.

Servers that die. With a gate (`rollout.supervisor`), a request goes only to a server that is up (with every
server down, it waits for one, within `request_timeout_s`); a request whose server died under it raises
`ServerLost` at once instead of being retried, and the rollout stream plays its episode again from the start
with its own seeds, on the restarted server or another (`rollout.stream`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from agent_rl.core.types import Message


class SamplerError(Exception):
    """The sampler could not produce a completion (server down, timeout, bad response)."""


class ServerLost(SamplerError):
    """The request's server went down with the request in flight (its gate says so): the episode is played again
    from its start (`rollout.stream`), not retried here, and it is not the episode's failure."""


class ServerGate(Protocol):
    """Which servers take requests now (`rollout.supervisor.Supervisor`): one that died, or stopped answering,
    takes none until it serves the current weights again."""

    def is_up(self, url: str) -> bool: ...

    async def wait_up(self, timeout_s: float) -> None:
        """Until some server is up; SamplerError past `timeout_s`, or once none of them can come back."""
        ...

    async def lost(self, url: str) -> bool:
        """A call to `url` failed at the connection: whether its server is down (a restart, or a wait, under way)."""
        ...


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # one per sampled token, under the sampling distribution
    finish_reason: str  # "stop" or "length" ("abort" only inside a served sampler, between the pieces of a turn)
    policy_version: int = 0  # the version that sampled the first token
    # the version that sampled each token; () on construction: every token is `policy_version`'s (a push
    # that aborted the request in the middle gives the later tokens the new version: module doc)
    versions: tuple[int, ...] = ()
    # the first `given` ids were not sampled by the policy but given (a branch's replayed turns, the part of a turn
    # it keeps and the opening of a call it forces: `rollout.branching`): context, out of the loss
    given: int = 0

    def __post_init__(self) -> None:
        if not self.versions:
            object.__setattr__(self, "versions", (self.policy_version,) * len(self.token_ids))
        if len(self.versions) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} token ids but {len(self.versions)} versions")
        if not 0 <= self.given <= len(self.token_ids):
            raise ValueError(f"{self.given} given ids of {len(self.token_ids)}")


class Sampler(Protocol):
    """Samples one assistant turn. `messages` is the conversation the ids render, for samplers that
    act on messages (a scripted solver); token samplers ignore it. `prompt_ids` is lent for the call only:
    the runner passes its episode's own buffer (a copy of ~1k ids a turn is not free), which grows once the
    call returns, so a sampler that keeps the ids keeps a copy of them."""

    policy_version: int

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
                     messages: Sequence[Message] = ()) -> Completion: ...


class ServedSampler(Sampler, Protocol):
    """A sampler over servers, as a weight sync sees it: the servers' URLs, the served policy (`model`: a served
    name, "base" or a loaded adapter's) that new requests go to, switched after a push, and the requests in
    flight, which a push that pauses the servers holds back (module doc); its gate, if a supervisor watches the
    servers (a push leaves out the servers that are down, whose restore brings them the weights)."""

    model: str
    gate: ServerGate | None

    @property
    def urls(self) -> list[str]: ...

    def set_policy(self, model: str, version: int) -> None: ...

    def hold(self) -> None:
        """New requests (and the continuations of aborted ones) wait until `release`."""
        ...

    def release(self) -> None: ...

    def in_flight(self, url: str | None = None, model: str | None = None) -> int:
        """Requests sent and not yet answered (to the server `url`, for the served policy `model`)."""
        ...
