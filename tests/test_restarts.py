"""What the rest of a run does while a server is down (a stand-in gate says which: `rollout.sampler.ServerGate`):
the sampler sends it nothing and, with every server down, waits; a request whose server died ends with
`ServerLost` at once (no retry of its own); the rollout stream replays that episode with its own seeds whatever
`rollout.on_error` says, free of `max_retries` and of the failure counts; a weight push leaves a server that is
down (or goes down during the push) out, and `restore` then gives it every version the others hold, after the
push under way. Stand-in vLLM servers: tests/helpers.py's `StandInVLLM`, which also list their adapters here."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from helpers import SavesAFile, StandInVLLM, TimedSampler, run_loop, scripted_run, total, until

from agent_rl.rollout.sampler import SamplerError, SamplingParams, ServerLost
from agent_rl.rollout.serving.vllm.sampler import VLLMSampler
from agent_rl.rollout.serving.vllm.server import free_port
from agent_rl.rollout.weight_sync.adapter import AdapterSync
from agent_rl.rollout.weight_sync.base import WeightSyncError
from agent_rl.rollout.weight_sync.full import FullWeightSync


class Gate:
    """Servers in `down` take no request; `lost(url)` says whether `url` is down (recording each call); `waiting`
    counts the requests waiting for a server to come up."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.asked: list[str] = []
        self.changed = asyncio.Event()
        self.waiting = 0

    def is_up(self, url: str) -> bool:
        return url not in self.down

    def set_up(self, url: str) -> None:
        self.down.discard(url)
        self.changed.set()

    async def wait_up(self, timeout_s: float) -> None:
        self.waiting += 1
        try:
            await asyncio.wait_for(self.changed.wait(), timeout_s)
        except TimeoutError:
            raise SamplerError("no server up") from None
        finally:
            self.waiting -= 1

    async def lost(self, url: str) -> bool:
        self.asked.append(url)
        return url in self.down


class Listing(StandInVLLM):
    """The stand-in, which also lists its adapters (`GET /v1/models`), as vLLM does; while `loads_wait_for` is an
    unset event, each adapter load waits for it (`loading` set as one begins)."""

    loads_wait_for: asyncio.Event | None = None
    loading: asyncio.Event | None = None

    async def control(self, request: web.Request) -> web.Response:
        if request.path == "/v1/load_lora_adapter" and self.loads_wait_for is not None:
            assert self.loading is not None
            self.loading.set()
            await self.loads_wait_for.wait()
        return await super().control(request)

    async def models(self, request: web.Request) -> web.Response:
        cards = [{"id": "base", "parent": None}, *({"id": a, "parent": "base"} for a in sorted(self.adapters))]
        return web.json_response({"data": cards})

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        super().routes(app)


PARAMS = SamplingParams(max_tokens=3, seed=1)


async def test_requests_go_only_to_servers_that_are_up_and_wait_when_none_is():
    async with Listing() as a, Listing() as b, VLLMSampler([a.url, b.url]) as sampler:
        sampler.gate = gate = Gate()
        gate.down.add(b.url)
        await asyncio.gather(*(sampler.sample([1, 2, 3], PARAMS) for _ in range(6)))
        assert len(a.served) == 6 and b.served == []
        gate.down.add(a.url)
        waiting = asyncio.ensure_future(sampler.sample([1, 2, 3], PARAMS))
        await until(lambda: gate.waiting == 1, "the request waiting for a server")
        assert not waiting.done() and len(a.served) + len(b.served) == 6  # nothing sent while every server is down
        gate.set_up(b.url)
        assert len((await asyncio.wait_for(waiting, 5.0)).token_ids) == 3 and len(b.served) == 1


async def test_a_request_whose_server_died_ends_with_server_lost_at_once():
    dead = f"http://127.0.0.1:{free_port()}"
    async with VLLMSampler([dead], retries=3, backoff_s=1.0) as sampler:
        sampler.gate = gate = Gate()

        async def down_on_lost(url: str) -> bool:  # the supervisor's answer once it sees the process gone
            gate.asked.append(url)
            gate.down.add(url)
            return True

        gate.lost = down_on_lost  # type: ignore[method-assign]
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(ServerLost, match=f"vLLM server {dead} went down with the request in flight"):
            await sampler.sample([1], PARAMS)
        assert gate.asked == [dead] and asyncio.get_running_loop().time() - t0 < 1.0  # one attempt, no backoff
    async with VLLMSampler([dead], retries=1, backoff_s=0.01) as sampler:
        sampler.gate = gate = Gate()  # the server is up as far as it knows: the failure is the request's own
        with pytest.raises(SamplerError, match="did not answer after 2 attempts") as e:
            await sampler.sample([1], PARAMS)
        assert not isinstance(e.value, ServerLost) and gate.asked == [dead, dead]


class LosesServers(TimedSampler):
    """Each request of `lost` tasks' first episode-attempts fails as its server dies (`ServerLost`); replays work."""

    def __init__(self, renderer, lost: set[str]):
        super().__init__(renderer, lambda prompt: 0.001)
        self.lost, self.seen = lost, set()

    async def sample(self, prompt_ids, params, messages=()):
        topic = self.renderer.render_text(prompt_ids)
        key = (topic, params.seed)
        if any(f"about {t}." in topic for t in self.lost) and key not in self.seen:
            self.seen.add(key)
            raise ServerLost("vLLM server http://h:1 went down with the request in flight")
        return await super().sample(prompt_ids, params, messages)


@pytest.mark.parametrize("policy", ["retry", "drop_group", "keep"])
async def test_an_episode_whose_server_died_is_replayed_whatever_on_error_says(policy, tmp_path, smol_dir, renderer):
    def steps(run_dir, sampler, *sets):
        tasks = [{"id": f"t{i}", "topic": "snails" if i in (1, 5) else "cats"} for i in range(12)]
        run = scripted_run(run_dir, smol_dir, renderer, tasks, "algorithm.max_staleness=0", *sets)
        return run_loop(run, sampler)

    clean, _ = await steps(tmp_path / "clean", TimedSampler(renderer, lambda prompt: 0.001))
    lost, lines = await steps(tmp_path / policy, LosesServers(renderer, {"snails"}), f"rollout.on_error={policy}",
                              "rollout.max_retries=0")
    as_data = [[(g.task_id, [(t.token_ids, t.reward, t.infra_error) for t in g.trajectories]) for g in s] for s in lost]
    assert as_data == [[(g.task_id, [(t.token_ids, t.reward, t.infra_error) for t in g.trajectories]) for g in s]
                       for s in clean]  # the batches an unfaulted run trains, token for token
    # t1 and t5 (2 rollouts each) played at steps 0 and 1, and at steps 4 and 5: each episode lost once
    assert total(lines, "fault/replayed_episodes") == 8
    assert [x["fault/replayed_episodes"] for x in lines[:2]] == [2.0, 2.0]
    assert total(lines, "error/retried") == 0 and total(lines, "error/dropped_groups") == 0
    assert not [k for x in lines for k in x if k.startswith("error/") and k not in ("error/retried",
                                                                                  "error/dropped_groups")]
    assert total(lines, "infra_error_rate") == 0


async def test_a_push_leaves_out_a_server_that_is_down_and_restore_brings_it_every_loaded_version(tmp_path):
    async with Listing() as a, Listing() as b, VLLMSampler([a.url, b.url]) as sampler:
        sampler.gate = gate = Gate()
        sync = AdapterSync(tmp_path, sampler, keep=2, prefix="p")
        for version in (0, 1):
            await sync.push(SavesAFile(), version)
        gate.down.add(b.url)
        b.adapters.clear()  # it died: a restarted server holds no adapter
        await sync.push(SavesAFile(), 2)
        assert a.adapters == {"p-v1", "p-v2"} and b.adapters == set()
        assert sampler.model == "p-v2" and sync.loaded == [1, 2]
        assert not (tmp_path / "adapters" / "v0").exists() and (tmp_path / "adapters" / "v1").is_dir()
        b.calls.clear()
        await sync.restore(b.url)
        assert b.calls == ["/v1/load_lora_adapter", "/v1/load_lora_adapter"] and b.adapters == {"p-v1", "p-v2"}
        b.adapters.discard("p-v2")  # an attached one that came back with some of them: only the others are loaded
        b.calls.clear()
        await sync.restore(b.url)
        assert b.calls == ["/v1/load_lora_adapter"] and b.adapters == {"p-v1", "p-v2"}


async def test_a_server_that_goes_down_during_a_push_is_left_out_of_it(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: its process died just now
    async with Listing() as a, VLLMSampler([a.url, dead]) as sampler:
        with pytest.raises(WeightSyncError, match=dead):  # unsupervised: the push fails, as it always did
            await AdapterSync(tmp_path / "bare", sampler, prefix="q").push(SavesAFile(), 0)
        sampler.gate = gate = Gate()  # up as far as the gate knows when the push begins
        gate.lost = lambda url: _down(gate, url)  # type: ignore[method-assign,assignment]
        sync = AdapterSync(tmp_path / "supervised", sampler, prefix="p")
        await sync.push(SavesAFile(), 0)
        assert sampler.model == "p-v0" and "p-v0" in a.adapters and gate.asked == [dead]
        full = FullWeightSync(tmp_path / "full", sampler)
        await full.push(SavesAFile(), 4)  # pause, reload, reset, resume on the server that is up; none to `dead`
        assert a.weights == 4 and a.calls[-1] == "/resume" and sampler.policy_version == 4 and gate.asked == [dead]


async def _down(gate: Gate, url: str) -> bool:
    gate.asked.append(url)
    gate.down.add(url)
    return True


async def test_a_restore_waits_for_the_push_under_way_and_brings_its_version(tmp_path):
    async with Listing() as a, Listing() as b, VLLMSampler([a.url, b.url]) as sampler:
        sampler.gate = gate = Gate()
        sync = AdapterSync(tmp_path, sampler, keep=2, prefix="p")
        await sync.push(SavesAFile(), 0)
        gate.down.add(b.url)
        b.adapters.clear()
        a.loads_wait_for, a.loading = asyncio.Event(), asyncio.Event()  # the push's load on the server that is up waits
        push = asyncio.ensure_future(sync.push(SavesAFile(), 1))
        # the push holds the servers' lock (it wrote v1 first, in a thread)
        await until(a.loading.is_set, "the push's adapter load on the server that is up")
        restore = asyncio.ensure_future(sync.restore(b.url))  # read now, the versions loaded would lack v1
        await asyncio.sleep(0.1)  # a window in which a restore that did not wait for the push would end
        assert not restore.done() and not push.done()
        a.loads_wait_for.set()
        await asyncio.wait_for(restore, 10)
        assert b.adapters == {"p-v0", "p-v1"} and "p-v1" in a.adapters
        # the push may still be pruning old version folders (off the lock, in a thread): it ends by itself
        assert await asyncio.wait_for(push, 10) >= 0


async def test_a_full_weight_restore_reloads_the_newest_version_and_nothing_before_a_push(tmp_path):
    async with Listing() as a, VLLMSampler([a.url]) as sampler:
        sync = FullWeightSync(tmp_path, sampler)
        await sync.restore(a.url)
        assert a.calls == []  # the server's own weights are the ones to serve
        await sync.push(SavesAFile(), 3)
        a.calls.clear()
        a.weights = 0  # restarted: its own weights
        await sync.restore(a.url)
        assert a.calls == ["/collective_rpc", "/reset_prefix_cache"] and a.weights == 3  # no pause: it serves nobody
