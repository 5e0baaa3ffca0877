"""Weight pushes while requests are in flight, against a stand-in vLLM server (aiohttp on localhost) whose
"weights" are a version number: every token it samples has log-prob -version, so a token's log-prob says
which weights sampled it, and the sampler's tag (`Completion.versions`) must say the same.

The stand-in does what vLLM 0.32's endpoints do (read in its source: `entrypoints/rl/online/api_router.py`,
`v1/engine/core.py` `pause_scheduler`, `v1/engine/output_processor.py` `abort_requests`): a paused server
queues new requests; `/pause?mode=abort` ends every running request with the tokens it has and finish_reason
"abort"; `/abort_requests` with no ids ends every request it holds, queued ones with no tokens;
`/collective_rpc reload_weights` swaps the weights; `/resume` runs the queue. Its tokens are 100 + their
position in the sequence, so a request continued from its partial output must come out as one unbroken run.
The real server: tests/test_push_integration.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web
from helpers import until

from agent_rl.rollout.sampler import SamplingParams
from agent_rl.rollout.serving.vllm.sampler import VLLMSampler
from agent_rl.rollout.weight_sync.adapter import AdapterSync
from agent_rl.rollout.weight_sync.full import FullWeightSync

TOKEN_S = 0.004  # seconds per sampled token


async def first_of(*events: asyncio.Event) -> None:
    """Until one of `events` is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


class StandInVLLM:
    """One stand-in server. `slow_prompt`: a request whose prompt starts with it takes `slow_s` to reach the
    engine, or, with `slow_s=None`, reaches it only once a pause has come (a request still in transit then).
    `hold_at`: a request that has sampled that many tokens waits (counted in `held`) until it is aborted or
    `release` is set; a pause sets it. A test then knows where the requests are when its push comes, however
    late a loaded machine runs it: a fixed sleep let requests end before the push, or start after it."""

    def __init__(self, slow_prompt: int | None = None, slow_s: float | None = 0.0, hold_at: int | None = None):
        self.weights, self.paused, self.url = 1, False, ""
        self.adapters: set[str] = set()
        self.calls: list[str] = []
        self.running: dict[int, asyncio.Event] = {}  # request -> its abort flag
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.slow_prompt, self.slow_s = slow_prompt, slow_s
        self.hold_at, self.held = hold_at, 0
        self.release, self.pause_came = asyncio.Event(), asyncio.Event()
        self.served: list[tuple[tuple[int, ...], str, int]] = []  # (prompt, model, tokens) of each request

    def version_of(self, model: str) -> int:
        return int(model.rsplit("-v", 1)[1]) if "-v" in model else self.weights

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        prompt, model = body["prompt"], body["model"]
        if self.slow_prompt is not None and prompt[0] == self.slow_prompt:
            await (self.pause_came.wait() if self.slow_s is None else asyncio.sleep(self.slow_s))
        abort = asyncio.Event()
        key = id(abort)
        self.running[key] = abort
        ids: list[int] = []
        lps: list[float] = []  # each token's, from the weights that sampled it
        finish = "length"
        try:
            while not self.resumed.is_set() and not abort.is_set():  # paused: queued
                await asyncio.wait([asyncio.ensure_future(self.resumed.wait()),
                                    asyncio.ensure_future(abort.wait())], return_when=asyncio.FIRST_COMPLETED)
            while len(ids) < body["max_tokens"] and not abort.is_set():
                if len(ids) == self.hold_at and not self.release.is_set():
                    self.held += 1
                    await first_of(self.release, abort)
                    self.held -= 1
                    continue
                await asyncio.sleep(TOKEN_S)
                if not abort.is_set():
                    ids.append(100 + len(prompt) + len(ids))
                    lps.append(-float(self.version_of(model)))
            if abort.is_set():
                finish = "abort"
        finally:
            del self.running[key]
        self.served.append((tuple(prompt), model, len(ids)))
        return web.json_response({"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": lps},
                                               "finish_reason": finish, "prompt_token_ids": prompt}]})

    async def control(self, request: web.Request) -> web.Response:
        path = request.path_qs
        self.calls.append(path)
        body = await request.json() if request.can_read_body else {}
        if path == "/pause?mode=abort":
            self.paused = True
            self.resumed.clear()
            for flag in self.running.values():
                flag.set()
            self.release.set()
            self.pause_came.set()
        elif path == "/abort_requests":
            for flag in self.running.values():
                flag.set()
        elif path == "/collective_rpc":
            self.weights = int(Path(body["kwargs"]["weights_path"]).name.removeprefix("v"))
        elif path == "/resume":
            self.paused = False
            self.resumed.set()
        elif path == "/v1/load_lora_adapter":
            self.adapters.add(body["lora_name"])
        elif path == "/v1/unload_lora_adapter":
            self.adapters.discard(body["lora_name"])
        return web.json_response({})

    def routes(self, app: web.Application) -> None:
        """What the stand-in answers (a subclass adds its own before these: the last is a catch-all)."""
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/{path:.*}", self.control)

    async def __aenter__(self) -> StandInVLLM:
        app = web.Application()
        self.routes(app)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


class SavesAFile:
    def save_pretrained(self, folder, safe_serialization: bool) -> None:
        (folder / "model.safetensors").write_text("weights")


def assert_tagged_by_what_sampled(out, prompt: list[int], n: int) -> None:
    """Every token's version is the weights that sampled it (its log-prob), and the turn is one unbroken run."""
    assert list(out.token_ids) == [100 + len(prompt) + i for i in range(n)]
    assert [-v for v in out.versions] == list(out.logprobs)


async def test_a_push_of_full_weights_aborts_requests_in_flight_and_they_go_on_under_the_new_version(tmp_path):
    """Eight requests of 40 tokens on version 1; once each has sampled 12 (held there by the stand-in until the
    pause), version 2 is pushed. Each comes back whole: its first tokens by version 1, the rest by version 2 (the
    push's pause aborted it and the sampler went on from its tokens); none is lost, none mixes versions under
    one tag."""
    async with StandInVLLM(hold_at=12) as server, VLLMSampler([server.url]) as sampler:
        sampler.set_policy("base", 1)
        sync = FullWeightSync(tmp_path, sampler)
        prompts = [[i, 7, 7] for i in range(8)]
        tasks = [asyncio.ensure_future(sampler.sample(p, SamplingParams(max_tokens=40, seed=i)))
                 for i, p in enumerate(prompts)]
        await until(lambda: server.held == 8, "8 requests held at their 12th token")
        await sync.push(SavesAFile(), 2)
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    for p, out in zip(prompts, outs):
        assert_tagged_by_what_sampled(out, p, 40)
        assert out.finish_reason == "length" and out.policy_version == 1
        assert out.versions.count(1) == 12 and out.versions[-1] == 2  # split by the push, where it found them
    assert server.calls[:1] == ["/pause?mode=abort"] and server.calls[-1] == "/resume"
    # each continuation's prompt: the original prompt and the tokens of its first piece
    continued = [(prompt, n) for prompt, model, n in server.served if len(prompt) > 3]
    assert len(continued) == 8 and all(len(prompt) - 3 + n == 40 for prompt, n in continued)


async def test_a_request_that_reaches_the_server_during_the_pause_is_swept_not_mislabelled(tmp_path):
    """A request sent under version 1 that reaches the engine only after the pause (in transit): the server
    would queue it and run it on version 2's weights after the resume, under version 1's tag. The push's
    sweep (`/abort_requests` while the sampler still has it in flight) ends it with no tokens, and the
    sampler sends it again under version 2: every token says 2, and its log-prob agrees."""
    async with StandInVLLM(slow_prompt=42, slow_s=None) as server, VLLMSampler([server.url]) as sampler:
        sampler.set_policy("base", 1)
        late = asyncio.ensure_future(sampler.sample([42, 7], SamplingParams(max_tokens=10, seed=0)))
        # sent; it reaches the engine after the pause
        await until(lambda: sampler.in_flight(server.url) == 1, "the late request sent")
        await FullWeightSync(tmp_path, sampler).push(SavesAFile(), 2)
        out = await asyncio.wait_for(late, 10)
    assert_tagged_by_what_sampled(out, [42, 7], 10)
    assert out.versions == (2,) * 10
    assert "/abort_requests" in server.calls and server.calls.index("/abort_requests") < server.calls.index("/resume")
    assert [(prompt, n) for prompt, _, n in server.served] == [((42, 7), 0), ((42, 7), 10)]


async def test_an_adapter_push_leaves_requests_in_flight_on_their_own_version(tmp_path):
    """Adapters need no pause: a 60-token request on version 1 runs (held by the stand-in at its 10th token, so
    that it still runs however long the pushes take) while versions 2 and 3 are pushed (keep = 2). Version 1
    stays loaded while the request runs on it (it is past the newest two), every token is version 1's; the next
    push, with nothing in flight on it, unloads it."""
    async with StandInVLLM(hold_at=10) as server, VLLMSampler([server.url]) as sampler:
        sync = AdapterSync(tmp_path, sampler, keep=2, prefix="p")
        write = SavesAFile()
        await sync.push(write, 1)
        long = asyncio.ensure_future(sampler.sample([1, 2], SamplingParams(max_tokens=60, seed=0)))
        await until(lambda: server.held == 1, "the request held at its 10th token")
        assert sampler.in_flight(model="p-v1") == 1
        await sync.push(write, 2)
        await sync.push(write, 3)
        assert server.adapters == {"p-v1", "p-v2", "p-v3"} and sync.loaded == [1, 2, 3] and server.held == 1
        server.release.set()
        out = await asyncio.wait_for(long, 10)
        assert_tagged_by_what_sampled(out, [1, 2], 60)
        assert out.versions == (1,) * 60
        await sync.push(write, 4)
        assert server.adapters == {"p-v3", "p-v4"} and sync.loaded == [3, 4]
        assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["v3", "v4"]
    assert "/pause?mode=abort" not in server.calls


async def test_a_push_that_fails_releases_the_sampler(tmp_path):
    """A reload refused: the servers resume and the sampler is released (a request sent afterwards runs)."""
    async with StandInVLLM() as server, VLLMSampler([server.url]) as sampler:
        sync = FullWeightSync(tmp_path, sampler)

        class Refuses(SavesAFile):
            def save_pretrained(self, folder, safe_serialization: bool) -> None:
                raise OSError("disk full")

        with pytest.raises(OSError, match="disk full"):
            await sync.push(Refuses(), 2)
        out = await asyncio.wait_for(sampler.sample([5], SamplingParams(max_tokens=3)), 5)
        assert out.versions == (0, 0, 0)
