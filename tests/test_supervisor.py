"""The supervisor's rules (`rollout.supervisor`) on stand-in servers: a process whose exit the test decides and a
/health the test answers, on real time with small bounds. A server that exits, or stops answering /health for
`health_timeout_s`, is stopped, launched again on its URL and restored before it is up; a failed start counts
against `max_restarts`; past it, or past `attach_wait_s` for an attached server, one line and `on_failure`; every
wait ends at its deadline."""

from __future__ import annotations

import asyncio

import pytest
from helpers import until

from agent_rl.rollout.sampler import SamplerError
from agent_rl.rollout.supervisor import Supervisor

URL = "http://127.0.0.1:9"


class Proc:
    def __init__(self) -> None:
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code


class StandIn:
    """A server the run started: `launch` makes a process that answers /health unless `answering` is False, or
    exits at once when the next entry of `start_fails` is True."""

    def __init__(self, url: str = URL, start_fails: tuple[bool, ...] = ()):
        self._url, self.start_fails = url, list(start_fails)
        self.proc: Proc | None = Proc()
        self.answering = True
        self.startup_timeout_s, self.log_path = 30.0, None  # a relaunch ends when it answers: no test waits it out
        self.launches, self.stops = 0, 0

    @property
    def url(self) -> str:
        return self._url

    def launch(self) -> None:
        self.launches += 1
        self.proc = Proc()
        if self.start_fails and self.start_fails.pop(0):
            self.proc.code = 1

    def stop(self) -> None:
        self.stops += 1
        if self.proc is not None and self.proc.code is None:
            self.proc.code = -15
        self.proc = None

    def log_tail(self) -> str:
        return "(stand-in log)"

    def die(self, code: int = -9) -> None:
        assert self.proc is not None
        self.proc.code = code


class Watch:
    """A supervisor over stand-ins, started with a restore that records the URL and whether it was up then."""

    def __init__(self, servers: list[StandIn] | None, urls: list[str], **kwargs):
        self.servers = servers
        by_url = {s.url: s for s in servers or []}
        self.answers: dict[str, bool] = {u: True for u in urls}  # attached servers' /health

        async def probe(url: str, timeout_s: float) -> bool:
            s = by_url.get(url)
            if s is None:
                return self.answers[url]
            return s.proc is not None and s.proc.code is None and s.answering

        settings = {"max_restarts": 2, "health_timeout_s": 0.3, "attach_wait_s": 0.5, "poll_s": 0.02, **kwargs}
        self.sup = Supervisor(urls, servers, probe=probe, **settings)
        self.restored: list[tuple[str, bool]] = []
        self.failures: list[Exception] = []

    async def restore(self, url: str) -> None:
        self.restored.append((url, self.sup.is_up(url)))

    async def __aenter__(self) -> Watch:
        await self.sup.__aenter__()
        self.sup.start(self.restore, self.failures.append)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.sup.__aexit__(*exc)


async def test_a_server_that_exits_is_restarted_on_its_url_and_restored_before_it_is_up():
    server = StandIn()
    async with Watch([server], [URL]) as w:
        server.die()
        await until(lambda: server.launches == 1 and w.sup.is_up(URL), "the server relaunched once and up")
        assert server.stops == 1  # what was left of it stopped, then launched once
        assert w.restored == [(URL, False)]  # restored while it took no request yet
        assert w.sup.metrics()["fault/restarts"] == 1.0
        assert w.sup.metrics() == {"fault/restarts": 0.0, "fault/reattached": 0.0, "fault/down_s": 0.0}  # once
        assert w.failures == [] and w.sup.failure is None


async def test_a_server_still_down_counts_its_down_time_up_to_each_call_and_the_rest_goes_to_the_next():
    server = StandIn()
    async with Watch([server], [URL]) as w:
        server.answering = False  # its restart waits for /health until the test lets it answer
        server.die()
        t0 = asyncio.get_running_loop().time()
        await until(lambda: server.launches == 1, "the server relaunched")
        await asyncio.sleep(0.2)  # down time, which the first call counts
        first = w.sup.metrics()
        assert first["fault/restarts"] == 1.0 and 0.2 <= first["fault/down_s"] <= asyncio.get_running_loop().time() - t0
        await asyncio.sleep(0.1)  # down time, which only the second call counts
        server.answering = True
        await until(lambda: w.sup.is_up(URL), "the server up again")
        second = w.sup.metrics()
        assert second["fault/restarts"] == 0.0 and second["fault/down_s"] >= 0.1  # only what the first did not count
        total = asyncio.get_running_loop().time() - t0
        assert first["fault/down_s"] + second["fault/down_s"] <= total
        assert w.sup.metrics()["fault/down_s"] == 0.0  # up again: nothing more


async def test_a_server_that_does_not_answer_health_is_dead_after_the_bound_not_before():
    server = StandIn()
    # 2 s, not 1: the check 0.3 s in must come before the bound even when a loaded machine wakes the test late
    async with Watch([server], [URL], health_timeout_s=2.0) as w:
        server.answering = False  # alive, hung
        t0 = asyncio.get_running_loop().time()
        await asyncio.sleep(0.3)  # hung this long, well within its 2 s
        assert w.sup.is_up(URL) and server.stops == 0  # within the bound: a slow answer is no death
        await until(lambda: server.launches == 1, "the server relaunched")
        assert asyncio.get_running_loop().time() - t0 >= 2.0
        server.answering = True  # the new process answers
        await until(lambda: w.sup.is_up(URL), "the server up again")
        assert server.stops == 1 and w.restored == [(URL, False)]


async def test_past_the_budget_one_line_on_failure_and_the_server_stopped():
    server = StandIn()
    async with Watch([server], [URL], max_restarts=1) as w:
        server.die()
        await until(lambda: server.launches == 1 and w.sup.is_up(URL), "the server relaunched once and up")
        server.die()
        await until(lambda: w.failures != [], "the supervisor's failure")
        assert str(w.failures[0]) == (f"vLLM server {URL} exited with status -9; restarted 1 time(s) already "
                                      f"(sampler.max_restarts: 1)")
        assert w.sup.failure is w.failures[0] and server.launches == 1
        await until(lambda: server.stops == 2, "the server stopped twice")  # nothing of it left behind
        with pytest.raises(SamplerError, match="restarted 1 time"):  # a request waiting for it ends at once
            await asyncio.wait_for(w.sup.wait_up(60.0), 1.0)


async def test_a_budget_of_0_gives_up_at_the_first_death():
    server = StandIn()
    async with Watch([server], [URL], max_restarts=0) as w:
        server.die(-6)
        await until(lambda: w.failures != [], "the supervisor's failure")
        assert str(w.failures[0]) == (f"vLLM server {URL} exited with status -6; restarted 0 time(s) already "
                                      f"(sampler.max_restarts: 0)")
        assert server.launches == 0 and w.restored == []


async def test_a_failed_start_counts_against_the_budget():
    server = StandIn(start_fails=(True, False))
    async with Watch([server], [URL], max_restarts=2) as w:
        server.die()
        await until(lambda: server.launches == 2 and w.sup.is_up(URL), "two launches, the second up")
        assert w.restored == [(URL, False)] and w.failures == []
        assert w.sup.metrics()["fault/restarts"] == 2.0  # each launch
    server = StandIn(start_fails=(True, True))
    async with Watch([server], [URL], max_restarts=2) as w:
        server.die()
        await until(lambda: w.failures != [], "the supervisor's failure")
        assert str(w.failures[0]).startswith(
            f"vLLM server {URL} failed to restart (it exited with status 1 during start-up; log None ends with: "
            f"(stand-in log)); restarted 2 time(s) already")


async def test_lost_says_whether_a_failed_call_found_its_server_down():
    server, other = StandIn(), StandIn("http://127.0.0.1:10")
    w = Watch([server, other], [server.url, other.url])
    async with w.sup:
        server.die()
        assert await w.sup.lost(server.url) is False  # not supervised before `start`: the error stands as it is
    server = StandIn()
    async with Watch([server, other], [server.url, other.url]) as w:
        server.die()
        assert await w.sup.lost(server.url) is True and not w.sup.is_up(server.url)
        assert await w.sup.lost(server.url) is True  # still down: every call in flight on it was lost
        assert w.sup.is_up(other.url)


async def test_an_alive_server_whose_call_failed_is_not_lost():
    server = StandIn()
    async with Watch([server], [URL]) as w:
        t0 = asyncio.get_running_loop().time()
        assert await w.sup.lost(URL) is False  # the call's own failure: retried as ever
        assert asyncio.get_running_loop().time() - t0 < 10.0 and w.sup.is_up(URL)  # its 2 s wait, not a hang


async def test_an_attached_server_is_waited_for_and_restored_when_it_answers_again():
    async with Watch(None, [URL], attach_wait_s=30.0) as w:  # ends when it answers: a long bound costs nothing
        w.answers[URL] = False
        assert await w.sup.lost(URL) is True and not w.sup.is_up(URL)
        await asyncio.sleep(0.2)  # silent this long: the supervisor waits for it
        w.answers[URL] = True
        await until(lambda: w.sup.is_up(URL), "the server up again")
        metrics = w.sup.metrics()
        assert w.restored == [(URL, False)] and metrics["fault/reattached"] == 1.0 and metrics["fault/restarts"] == 0


async def test_an_attached_server_past_its_wait_is_one_line():
    async with Watch(None, [URL], attach_wait_s=0.3) as w:
        w.answers[URL] = False
        t0 = asyncio.get_running_loop().time()
        await w.sup.lost(URL)
        await until(lambda: w.failures != [], "the supervisor's failure")
        assert asyncio.get_running_loop().time() - t0 >= 0.3
        assert str(w.failures[0]) == (f"vLLM server {URL} stopped answering and did not answer again within 0.3 s "
                                      f"(sampler.attach_wait_s)")


async def test_requests_wait_for_a_server_with_a_deadline():
    server = StandIn()
    async with Watch([server], [URL]) as w:
        await w.sup.wait_up(0.01)  # up: no wait
        server.answering = False
        server.die()
        await until(lambda: not w.sup.is_up(URL), "the server seen down")
        server.answering = True
        await asyncio.wait_for(w.sup.wait_up(30.0), 30.0)  # until the restart is done
        assert w.sup.is_up(URL)
    slow = StandIn()
    slow.startup_timeout_s = 30.0
    async with Watch([slow], [URL]) as w:
        slow.answering = False  # hung, and so will be its restart, for as long as the test lasts
        slow.die()
        await until(lambda: not w.sup.is_up(URL), "the server seen down")
        with pytest.raises(SamplerError, match=r"no vLLM server was up within 0.2 s"):
            await w.sup.wait_up(0.2)
