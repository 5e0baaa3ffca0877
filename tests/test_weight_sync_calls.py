"""The requests a weight sync sends, against stand-in servers (aiohttp on localhost) that note every POST.

The one reload-in-place sequence (`weight_sync.base.Servers.reload_in_place`: pause with abort, reload, reset
the prefix cache, resume; with nothing in flight, no sweep) is what `FullWeightSync.push` and
`MergedSync.finish` send, written out by hand;
a reload refused by one server still resumes every server and leaves the sampler on its version; the
syncs with nothing to restore send nothing from `finish`. The real vLLM side is tests/test_weight_sync.py.
"""

from __future__ import annotations

import pytest
from aiohttp import web
from helpers import SavesAFile, serve_app
from transformers import LlamaConfig, LlamaForCausalLM

from agent_rl.learn.policy import apply_lora
from agent_rl.rollout.serving.vllm.sampler import VLLMSampler
from agent_rl.rollout.weight_sync.adapter import AdapterSync
from agent_rl.rollout.weight_sync.base import WeightSyncError
from agent_rl.rollout.weight_sync.full import FullWeightSync
from agent_rl.rollout.weight_sync.merged import MergedSync


class StandIn:
    """A server answering every POST with `{}` (or 500 on `fail`), noting (path with query, JSON body)."""

    def __init__(self, fail: str | None = None):
        self.fail, self.calls, self.url = fail, [], ""

    async def handle(self, request: web.Request) -> web.Response:
        self.calls.append((request.path_qs, await request.json()))
        if request.path == self.fail:
            return web.Response(status=500, text="boom")
        return web.json_response({})

    async def __aenter__(self) -> StandIn:
        app = web.Application()
        app.router.add_post("/{path:.*}", self.handle)
        self.runner, self.url = await serve_app(app)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


def reload_calls(folder) -> list[tuple[str, dict]]:
    return [("/pause?mode=abort", {}),
            ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder.resolve())}}),
            ("/reset_prefix_cache", {}), ("/resume", {})]


async def test_a_full_weight_push_is_pause_reload_reset_resume_on_every_server(tmp_path):
    async with StandIn() as a, StandIn() as b:
        sampler = VLLMSampler([a.url, b.url])
        sync = FullWeightSync(tmp_path, sampler)
        await sync.push(SavesAFile(), 1)
        assert a.calls == b.calls == reload_calls(tmp_path / "weights" / "v1")
        assert (sampler.model, sampler.policy_version) == ("base", 1)
        assert set(sync.last_timings) == {"save_s", "drain_s", "reload_s", "resume_s"}
        await sync.finish()  # nothing to restore: nothing sent
        assert len(a.calls) == len(b.calls) == 4


async def test_a_reload_refused_by_one_server_resumes_both_and_keeps_the_version(tmp_path):
    async with StandIn() as a, StandIn(fail="/collective_rpc") as b:
        sampler = VLLMSampler([a.url, b.url])
        with pytest.raises(WeightSyncError, match=rf"vLLM server {b.url} refused reloading weights from .*v1 "
                                                  r"\(HTTP 500\): 'boom'"):
            await FullWeightSync(tmp_path, sampler).push(SavesAFile(), 1)
        # a reloaded, so it drops its cache (blocks of the old weights); b refused the reload: no reset
        assert [path for path, _ in a.calls] == ["/pause?mode=abort", "/collective_rpc", "/reset_prefix_cache",
                                                 "/resume"]
        assert [path for path, _ in b.calls] == ["/pause?mode=abort", "/collective_rpc", "/resume"]
        assert sampler.policy_version == 0


def tiny_lora(name_or_path: str):
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    model = apply_lora(LlamaForCausalLM(config), rank=2, alpha=4)
    model.get_base_model().config._name_or_path = name_or_path
    return model


@pytest.mark.parametrize("fail", [None, "/collective_rpc"])
async def test_merged_finish_reloads_the_base_folder_and_always_removes_its_versions(tmp_path, fail):
    base = tmp_path / "base-model"
    async with StandIn(fail=fail) as server:
        sync = MergedSync(tmp_path, VLLMSampler([server.url]), tiny_lora(str(base)))
        sync.weights_dir.mkdir(parents=True)  # where the versions go (/dev/shm when it has room)
        if fail:
            with pytest.raises(WeightSyncError, match=r"refused reloading weights from .*base-model"):
                await sync.finish()
            assert [path for path, _ in server.calls] == ["/pause?mode=abort", "/collective_rpc", "/resume"]
        else:
            await sync.finish()
            assert server.calls == reload_calls(base)
        assert not sync.weights_dir.exists()


async def test_an_adapter_sync_has_nothing_to_restore(tmp_path):
    async with StandIn() as server:
        await AdapterSync(tmp_path, VLLMSampler([server.url])).finish()
        assert server.calls == []
