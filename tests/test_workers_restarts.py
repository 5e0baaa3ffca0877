"""Restarts and rollout workers together (`rollout.remote_gate`): every worker's sampler routes by rank 0's
supervisor. A worker's gate (`MirrorGate`) says which servers are up as rank 0 last told it, waits (with a deadline)
while none is, and asks rank 0 whether a server whose call failed at the connection is down, raising `ServerLost`
only when rank 0 says so; an episode lost so is marked on its trajectory (`Trajectory.server_lost`, not its error's
text), travels back and is replayed free of `rollout.on_error`. In the real loop, stream, supervisor and 2 Ray
workers against stand-in servers in processes of their own (tests/standin_server.py), one SIGKILLed while both
workers have requests on it: the batches equal an unfaulted run's token for token, no `error/*` is counted, the
replays are, and the restarted server takes no worker's request before its restore has ended."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import SavesAFile, TimedSampler, VersionSync, essence, here, run_loop, scripted_run, toy_tasks, until

from agent_rl.core.types import Message
from agent_rl.envs.toy import BrevityEnv
from agent_rl.rollout import remote_gate
from agent_rl.rollout.remote_gate import GateState, MirrorGate
from agent_rl.rollout.runner import EpisodeLimits, run_episode
from agent_rl.rollout.sampler import SamplerError, ServerLost
from agent_rl.rollout.serving.choose import serving_backend
from agent_rl.rollout.serving.vllm.server import free_port
from agent_rl.rollout.supervisor import Supervisor
from agent_rl.rollout.weight_sync.full import FullWeightSync
from agent_rl.rollout.worker import WorkerSettings
from agent_rl.rollout.workers import rollout_workers

TESTS = Path(__file__).resolve().parent
A, B = "http://a:1", "http://b:2"


# -- a worker's gate, alone ---------------------------------------------------------------------------------------

async def test_a_workers_gate_routes_and_waits_by_the_state_rank_0_sent():
    gate = MirrorGate(lambda: None)
    gate.adopt(GateState((A, B), frozenset({A})))
    assert not gate.is_up(A) and gate.is_up(B) and gate.is_up("http://elsewhere:3")
    await asyncio.wait_for(gate.wait_up(5.0), 1.0)  # B is up: no wait
    gate.adopt(GateState((A, B), frozenset({A, B})))
    waiting = asyncio.ensure_future(gate.wait_up(5.0))
    await asyncio.sleep(0)  # one turn of the loop: the task's first step runs before this test resumes (it waits)
    assert not waiting.done()
    gate.adopt(GateState((A, B), frozenset({B})))  # A back (restored on rank 0 before this state was sent)
    await asyncio.wait_for(waiting, 1.0)
    gate.adopt(GateState((A, B), frozenset({A, B})))
    t0 = time.monotonic()
    with pytest.raises(SamplerError, match=r"^no vLLM server was up within 0.2 s \(sampler.request_timeout_s\); "
                                           r"down: http://a:1, http://b:2$"):
        await gate.wait_up(0.2)
    assert 0.15 < time.monotonic() - t0 < 2.0
    waiting = asyncio.ensure_future(gate.wait_up(30.0))
    await asyncio.sleep(0)  # it waits now
    assert not waiting.done()
    gate.adopt(GateState((A, B), frozenset({A, B}), "vLLM server http://a:1 exited with status -9; restarted 3 "
                                                      "time(s) already (sampler.max_restarts: 3)"))
    with pytest.raises(SamplerError, match=r"^vLLM server http://a:1 exited with status -9; restarted 3 time"):
        await asyncio.wait_for(waiting, 1.0)  # the run is stopping: no wait to its end


async def test_a_workers_gate_asks_rank_0_once_per_server_and_says_lost_only_on_its_word(monkeypatch):
    asked = []
    gate = MirrorGate(lambda: asked.append(True))
    gate.adopt(GateState((A, B), frozenset({A})))
    assert await gate.lost(A) and gate.questions() == [] and asked == []  # down already: no question
    first, second = asyncio.ensure_future(gate.lost(B)), asyncio.ensure_future(gate.lost(B + "/"))
    await asyncio.sleep(0)  # one turn of the loop: both tasks' first steps run before this test resumes
    assert gate.asking and gate.questions() == [B] and asked == [True] and not gate.asking  # one question for both
    gate.answer(B, False)  # alive: the failure was the call's own
    assert await first is False and await second is False
    third = asyncio.ensure_future(gate.lost(B))
    await asyncio.sleep(0)
    assert gate.questions() == [B]
    gate.adopt(GateState((A, B), frozenset({A, B})))  # the state that says B is down answers it too
    assert await asyncio.wait_for(third, 1.0) is True
    monkeypatch.setattr(remote_gate, "ANSWER_WAIT_S", 0.1)
    gate.adopt(GateState((A, B), frozenset()))
    assert await gate.lost(A) is False  # no answer within the deadline: not lost (the caller retries)


# -- the marker: the episode's own request, not an error's text ---------------------------------------------------

class LosesItsServer:
    policy_version = 0

    async def sample(self, prompt_ids, params, messages=()):
        raise ServerLost("vLLM server http://h:1 went down with the request in flight")


class RaisesServerLost(BrevityEnv):
    """An environment whose own code raises an exception of that name (a client of its own): its failure."""

    async def step(self, reply: Message, turn: int):
        raise ServerLost("the environment's own service went away")


async def test_only_the_episodes_own_request_marks_it_server_lost(renderer):
    limits = EpisodeLimits(max_turns=1, max_tokens_per_turn=8, seed=0)
    lost = await run_episode(BrevityEnv({"topic": "cats"}), LosesItsServer(), renderer, limits)
    assert lost.infra_error and lost.server_lost and lost.error.startswith("ServerLost: vLLM server http://h:1")
    env_failed = await run_episode(RaisesServerLost({"topic": "cats"}), TimedSampler(renderer, lambda p: 0.0),
                                   renderer, limits)
    assert env_failed.infra_error and not env_failed.server_lost
    assert env_failed.error == "ServerLost: the environment's own service went away"  # same text, not a replay


async def test_an_environment_raising_that_name_is_its_failure_and_spends_retries(tmp_path, smol_dir, renderer):
    """Were the text the marker, this run would replay the episode for ever, free of any budget."""
    run = scripted_run(tmp_path, smol_dir, renderer, toy_tasks(6), "algorithm.max_staleness=0", "run.steps=1",
                       "rollout.max_retries=1")
    make_env = run.session.env.make_env

    def make(task):
        return RaisesServerLost(task) if task["id"] == "t1" else make_env(task)

    run.session = dataclasses.replace(run.session, env=dataclasses.replace(run.session.env, make_env=make))
    seen, lines = await run_loop(run, TimedSampler(renderer, lambda prompt: 0.001))
    assert lines[0]["error/ServerLost"] == 4.0  # t1's 2 episodes, each tried twice (max_retries 1)
    assert lines[0]["error/retried"] == 2.0 and lines[0]["fault/replayed_episodes"] == 0.0
    assert "t1" not in [g.task_id for g in seen[0]] and lines[0]["error/dropped_groups"] == 0  # refilled


# -- a server killed while 2 workers play -------------------------------------------------------------------------

class StandInProcess:
    """A stand-in server the run started (`rollout.serving.base.ServerProcess`): tests/standin_server.py on a port of
    its own, which a restart launches again."""

    startup_timeout_s = 60.0

    def __init__(self, log_dir: Path, name: str):
        self.port, self.log_path = free_port(), log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.launches = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> None:
        self.launches += 1
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, str(TESTS / "standin_server.py"), str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT)

    def wait(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).close()
                return
            except OSError:
                assert time.monotonic() < deadline, self.log_tail()
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def log_tail(self) -> str:
        return self.log_path.read_text()[-2000:] if self.log_path.is_file() else ""

    def served(self) -> dict:
        with urllib.request.urlopen(self.url + "/served", timeout=5) as resp:
            return json.loads(resp.read())


async def kill_while_both_workers_use(sampler, server: StandInProcess) -> list[int]:
    """SIGKILL `server` (frozen before the run: `play_supervised`) once every worker has a request in flight on it;
    the counts then, by worker. Frozen, it answers none of them before the kill: a server that ran on could answer
    a counted request (~0.25 s) before the kill that the count waited for."""
    deadline = time.monotonic() + 60
    while True:
        counts = [n or 0 for _, n in sampler.pool.control("in_flight", server.url, None)]
        if len(counts) == 2 and min(counts) >= 1:
            assert server.proc is not None
            os.kill(server.proc.pid, signal.SIGKILL)
            return counts
        assert time.monotonic() < deadline, f"the workers never both had a request on {server.url}: {counts}"
        await asyncio.sleep(0.01)


class WaitingSync(VersionSync):
    """`helpers.VersionSync`, each push after `before(version)`: at k = 0 the next step waits for it."""

    def __init__(self, sampler, before):
        super().__init__(sampler)
        self.before = before

    async def push(self, model, version):
        await self.before(version)
        return await super().push(model, version)


async def play_supervised(run_dir, servers, smol_dir, renderer, workers: int, kill: StandInProcess | None = None):
    """3 steps of 4 toy tasks x 2 episodes of one 60-token turn (~0.25 s a request) on `servers`, supervised;
    every token is sampled with the weights of version 0 (log-prob -0.0; a stand-in's own weights give -1). With
    `kill`: killed in step 0; step 1 plays while its restart is being restored, step 2 once it is back."""
    urls = [s.url for s in servers]
    run = scripted_run(run_dir, smol_dir, renderer, toy_tasks(16), "rollout.tasks_per_step=4", "run.steps=3",
                       "rollout.max_tokens_per_turn=60", "algorithm.max_staleness=0")
    import ray_kits

    kit = functools.partial(ray_kits.served_kit, tuple(urls), str(smol_dir))
    restored: list[tuple[str, float]] = []
    async with serving_backend().sampler(urls) as local, Supervisor(urls, servers, max_restarts=2, health_timeout_s=20,
                                                       attach_wait_s=20, poll_s=0.1) as supervisor:
        supervisor.bind(local)
        async with rollout_workers(workers, kit, local, here(run, local), WorkerSettings()) as served:
            sampler = served.sampler
            sync = FullWeightSync(run_dir / "sync", sampler)
            await sync.push(SavesAFile(), 0)

            restoring = asyncio.Event()

            async def slow_restore(url: str) -> None:  # no worker may send it a request before this ends
                restoring.set()
                await asyncio.sleep(1.0)
                await sync.restore(url)
                restored.append((url, (await asyncio.to_thread(servers[urls.index(url)].served))["served"]))

            failures: list[Exception] = []
            supervisor.start(slow_restore, failures.append)
            run.supervisor = supervisor
            if kill is not None:  # frozen: its listening socket still takes the connections (see the kill)
                assert kill.proc is not None
                os.kill(kill.proc.pid, signal.SIGSTOP)
            killing = asyncio.ensure_future(kill_while_both_workers_use(sampler, kill)) if kill else None

            async def before_push(version: int) -> None:
                if kill is None:
                    return
                if version == 1:  # step 1 plays while the restarted server answers /health, not yet restored
                    await asyncio.wait_for(restoring.wait(), 120)
                if version == 2:  # step 2 on every server
                    await until(lambda: all(s.up for s in supervisor.servers), "the killed server back up", 120)

            seen, lines = await run_loop(run, served.sampler, players=served.players, train_s=0,
                                         sync=WaitingSync(served.sampler, before_push))
            in_flight = await killing if killing is not None else []
    assert failures == []
    return seen, lines, restored, in_flight


async def test_a_server_killed_while_2_workers_play_costs_replays_not_errors(tmp_path, smol_dir, renderer, ray_local):
    servers = [StandInProcess(tmp_path, f"standin-{i}") for i in range(2)]
    for s in servers:
        s.launch()
    try:
        for s in servers:
            await asyncio.to_thread(s.wait)
        clean, clean_lines, _, _ = await play_supervised(tmp_path / "clean", servers, smol_dir, renderer, 0)
        seen, lines, restored, in_flight = await play_supervised(tmp_path / "killed", servers, smol_dir, renderer, 2,
                                                                 kill=servers[0])
        after = servers[0].served()
    finally:
        for s in servers:
            s.stop()
    assert essence(seen) == essence(clean)  # the batches of an unfaulted run, token for token
    sampled = [lp for step in seen for g in step for t in g.trajectories for lp, m in zip(t.logprobs, t.loss_mask)
               if m]
    assert len(sampled) == 3 * 8 * 60 and set(sampled) == {-0.0}  # no token of the restarted server's own weights
    # each worker had a request on the server when it died: each such episode was replayed, none failed
    assert min(in_flight) >= 1 and sum(x["fault/replayed_episodes"] for x in lines) >= 2
    assert lines[0]["fault/replayed_episodes"] >= 2 and lines[1]["fault/replayed_episodes"] == 0 == \
        lines[2]["fault/replayed_episodes"]
    assert not [k for x in lines for k in x if k.startswith("error/") and x[k] and k != "error/dropped_groups"]
    assert sum(x["error/dropped_groups"] for x in lines) == 0 and sum(x["infra_error_rate"] for x in lines) == 0
    assert sum(x["fault/restarts"] for x in lines) == 1 and servers[0].launches == 2
    # restored once, having served nothing before its restore ended (step 1 played meanwhile), then part of step 2
    assert [(url, n) for url, n in restored] == [(servers[0].url, 0)] and after["served"] > 0
    assert after["weights"] == 0
    assert sum(x["fault/replayed_episodes"] for x in clean_lines) == 0
