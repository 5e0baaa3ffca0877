"""Weight pushes and evaluation with the episodes on rollout workers (`rollout.workers.PooledSampler`), against
tests/helpers.py's stand-in vLLM server (a token's log-prob is minus the version of the weights that
sampled it): a push of weights reloaded in place holds every worker's sampler and aborts their requests, which go
on under the new version with every token tagged by what sampled it; an adapter push keeps an old adapter loaded
while a worker's request still runs on it; `agent-rl eval`'s `evaluate` gives the same report on 2 workers as in
one process. The workers build their sampler themselves (tests/ray_kits.py `served_kit`, or the run's own
`session.worker_kit`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools

from helpers import SavesAFile, StandInVLLM, not_here, until

from agent_rl.config.file import load_config
from agent_rl.evaluation.evaluate import evaluate
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.rollout.serving.base import Fleet
from agent_rl.rollout.serving.choose import serving_backend
from agent_rl.rollout.weight_sync.adapter import AdapterSync
from agent_rl.rollout.weight_sync.full import FullWeightSync
from agent_rl.rollout.worker import WorkerSettings
from agent_rl.rollout.workers import rollout_workers
from agent_rl.session import open_session


def sampled(t):
    """(token version, its log-prob) of every sampled token."""
    return [(v, lp) for v, lp, m in zip(t.versions, t.logprobs, t.loss_mask) if m]


async def test_a_push_of_full_weights_reaches_the_workers_requests_in_flight(tmp_path, ray_local, smol_dir):
    """Eight one-turn episodes of 80 tokens on 2 workers, version 1; version 2 is pushed while they run (each held
    by the stand-in at its 25th token until the pause: a fixed wait let requests end before a late push). Every
    token's tag is the version whose weights sampled it (its log-prob): the requests the pause aborted went on
    under version 2, and none ran on version 2's weights under version 1's tag."""
    import ray_kits

    limits = EpisodeLimits(max_turns=1, max_tokens_per_turn=80, max_total_tokens=400, seed=0)
    async with StandInVLLM(hold_at=25) as server, serving_backend().sampler([server.url]) as local:
        local.set_policy("base", 1)
        kit = functools.partial(ray_kits.served_kit, (server.url,), str(smol_dir))
        async with rollout_workers(2, kit, local, not_here(local, None), WorkerSettings()) as served:
            sampler = served.sampler
            episodes = [asyncio.ensure_future(served.players.play({"id": f"t{i}", "topic": "cats"}, 0, limits))
                        for i in range(8)]
            # every request has left a worker (each count blocks this loop, the stand-in server's too, for a round
            # trip to the workers: polled every 10 ms, not 5)
            await until(lambda: sampler.in_flight() >= 8, "8 requests in flight on the workers", every_s=0.01)
            await until(lambda: server.held == 8, "8 requests held at their 25th token")  # 25 tokens each
            await FullWeightSync(tmp_path, sampler).push(SavesAFile(), 2)
            trajs = await asyncio.wait_for(asyncio.gather(*episodes), 60)
            stats = sampler.stats()
    assert all(s["episodes"] > 0 for s in stats.values()) and len(stats) == 2
    for t in trajs:
        assert t.error is None and len(sampled(t)) == 80
        assert all(lp == -v for v, lp in sampled(t))  # tagged by what sampled it
        versions = [v for v, _ in sampled(t)]
        assert versions == sorted(versions) and versions[-1] == 2  # the end under the new weights
    # split by the push, where it found them: 25 tokens in
    assert [[v for v, _ in sampled(t)].count(1) for t in trajs] == [25] * 8
    assert server.calls[0] == "/pause?mode=abort" and server.calls[-1] == "/resume"


async def test_an_adapter_stays_loaded_while_a_workers_request_runs_on_it(tmp_path, ray_local, smol_dir):
    """An adapter push needs no pause: a 150-token episode on a worker runs on p-v1 (held by the stand-in at its
    10th token until the pushes are done: a loaded machine may need longer for them than a turn takes) while
    p-v2 and p-v3 are pushed (keep 2). p-v1 stays loaded, counted in flight on the worker; once the episode has
    ended, the next push unloads it. Every token of the episode is version 1's."""
    import ray_kits

    limits = EpisodeLimits(max_turns=1, max_tokens_per_turn=150, max_total_tokens=400, seed=0)
    async with StandInVLLM(hold_at=10) as server, serving_backend().sampler([server.url]) as local:
        kit = functools.partial(ray_kits.served_kit, (server.url,), str(smol_dir))
        async with rollout_workers(2, kit, local, not_here(local, None), WorkerSettings()) as served:
            sampler = served.sampler
            sync, write = AdapterSync(tmp_path, sampler, keep=2, prefix="p"), SavesAFile()
            await sync.push(write, 1)
            long = asyncio.ensure_future(served.players.play({"id": "t", "topic": "cats"}, 0, limits))
            await until(lambda: sampler.in_flight(model="p-v1") >= 1, "the request on p-v1 in flight", every_s=0.01)
            await until(lambda: server.held == 1, "the request held at its 10th token")
            await sync.push(write, 2)
            await sync.push(write, 3)
            assert server.adapters == {"p-v1", "p-v2", "p-v3"} and sync.loaded == [1, 2, 3] and server.held == 1
            server.release.set()
            traj = await asyncio.wait_for(long, 60)
            assert sampler.in_flight(model="p-v1") == 0
            await sync.push(write, 4)
            assert server.adapters == {"p-v3", "p-v4"} and sync.loaded == [3, 4]
    assert [v for v, _ in sampled(traj)] == [1] * 150 and all(lp == -1.0 for _, lp in sampled(traj))
    assert "/pause?mode=abort" not in server.calls


def figures(report):
    """Every figure but the seconds scoring took (wall clock), NaN as a string (NaN != NaN)."""
    return {k: str(v) for k, v in report["results"]["base"].items() if not k.startswith("reward_time")}


async def test_evaluation_on_workers_reports_what_one_process_reports(ray_local, tmp_path):
    """`evaluate` (what `agent-rl eval` runs) with `rollout.workers: 2` and with 0: the same tasks, seeds and
    figures; the workers build the run's own kit (`session.worker_kit`)."""
    async with StandInVLLM() as server:

        @contextlib.contextmanager
        def serve(model_dir):
            yield Fleet([server.url])

        reports = {}
        for workers in (0, 2):
            cfg = load_config(None, ["rollout.env=toy", "rollout.max_turns=1", "rollout.max_tokens_per_turn=24",
                                     "eval.tasks=6", "eval.samples=3", f"rollout.workers={workers}",
                                     f"sampler.server_urls=[{server.url}]"])
            reports[workers] = await evaluate(open_session(cfg), ["base"], serve)
            served = len(server.served)
    assert figures(reports[2]) == figures(reports[0]) and reports[0]["results"]["base"]["rollouts"] == 18
    assert served == 36  # 18 episodes of one turn, twice
