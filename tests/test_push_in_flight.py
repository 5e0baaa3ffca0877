"""Weight pushes while requests are in flight, against a stand-in vLLM server (tests/helpers.py's `StandInVLLM`:
aiohttp on localhost, doing what vLLM's pause, abort, reload and resume endpoints do) whose "weights" are a version
number: every token it samples has log-prob -version, so a token's log-prob says which weights sampled it, and the
sampler's tag (`Completion.versions`) must say the same. The real server: tests/test_push_integration.py.
"""

from __future__ import annotations

import asyncio

import pytest
from helpers import SavesAFile, StandInVLLM, until

from agent_rl.rollout.sampler import SamplingParams
from agent_rl.rollout.serving.vllm.sampler import VLLMSampler
from agent_rl.rollout.weight_sync.adapter import AdapterSync
from agent_rl.rollout.weight_sync.full import FullWeightSync


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
