"""Calls pipelined on a worker's pipe (tools.worker_pool): written behind a busy worker's calls, answered in order,
and a call's deadline starts when it runs. A worker that overruns, dies or is cancelled mid-call takes only the call
it ran with it: the calls written behind it are answered by another worker."""

from __future__ import annotations

import asyncio
import time

import pytest
import slow_tools
from helpers import until

from agent_rl.tools import worker_pool
from agent_rl.tools.runners import function_address
from agent_rl.tools.worker_pool import WorkerPool, frame

POWER, REFUSE, MIRROR = (function_address(f) for f in (slow_tools.big_power, slow_tools.refuse, slow_tools.mirror))


async def within(awaitable, seconds: float = 20.0):
    """The awaited value, or the test fails in `seconds` instead of at the suite's per-test timeout."""
    return await asyncio.wait_for(awaitable, seconds)


def pid(reply: tuple[str, str]) -> int:
    assert reply[0] == "ok", reply
    return int(reply[1].split()[1].rstrip(":"))


async def test_calls_beyond_the_workers_are_written_behind_busy_ones_and_answered_in_order():
    pool = WorkerPool(size=2, depth=4)
    await asyncio.gather(*(pool.call(MIRROR, {"text": "ab", "times": 1}, 10.0) for _ in range(2)))  # both up
    calls = [asyncio.ensure_future(pool.call(MIRROR, {"text": f"{i}-", "times": 2}, 10.0)) for i in range(20)]
    await asyncio.sleep(0)  # every call has been dispatched: 2 workers x depth 4 written, the rest wait
    assert sorted(len(w.calls) for w in pool.workers) == [4, 4] and len(pool._waiting) == 12
    assert [r[1] for r in await within(asyncio.gather(*calls))] == [f"{i}-"[::-1] * 2 for i in range(20)]
    assert len(pool.workers) == 2 and not pool._waiting and all(not w.calls and w.unread == 0 for w in pool.workers)


async def test_an_overrun_kills_only_its_call_and_the_calls_behind_it_start_their_deadlines_elsewhere():
    """One worker: a call that would take minutes overruns its 1 s; the two written behind it, whose deadline is
    0.5 s, waited for it longer than that, yet their deadlines start only when they run: on a fresh worker."""
    pool = WorkerPool(size=1, depth=8)
    first = pid(await pool.call(POWER, {"exponent": 10}, 5.0))
    t0 = time.monotonic()
    slow = asyncio.ensure_future(pool.call(POWER, {"exponent": 10**8}, 1.0))
    behind = [asyncio.ensure_future(pool.call(POWER, {"exponent": 10}, 0.5)) for _ in range(2)]
    await asyncio.sleep(0)
    assert [len(w.calls) for w in pool.workers] == [3]  # all three on the one worker's pipe
    with pytest.raises(TimeoutError):
        await within(slow)
    assert 0.9 < time.monotonic() - t0 < 3.0
    replies = await within(asyncio.gather(*behind))
    assert {pid(r) for r in replies} != {first} and len({pid(r) for r in replies}) == 1  # one fresh worker
    assert all(r[1].endswith("29 bits") for r in replies)


async def test_a_worker_that_dies_fails_the_call_it_ran_and_the_ones_behind_it_are_answered():
    pool = WorkerPool(size=1, depth=8)
    await pool.call(REFUSE, {"text": "refuse"}, 5.0)
    dying = asyncio.ensure_future(pool.call(REFUSE, {"text": "exit later"}, 5.0))
    behind = [asyncio.ensure_future(pool.call(MIRROR, {"text": f"{i}x", "times": 1}, 5.0)) for i in range(3)]
    await asyncio.sleep(0)
    assert [len(w.calls) for w in pool.workers] == [5]  # the exit, the mirror module's import and three calls
    with pytest.raises(RuntimeError, match=r"^the worker process exited \(status 3\) during the call$"):
        await within(dying)
    assert [r[1] for r in await within(asyncio.gather(*behind))] == ["x0", "x1", "x2"]


async def test_a_call_cancelled_before_it_runs_leaves_its_worker_alone_and_one_cancelled_while_it_runs_kills_it():
    pool = WorkerPool(size=1, depth=8)
    first = pid(await pool.call(POWER, {"exponent": 10}, 5.0))
    slow = asyncio.ensure_future(pool.call(POWER, {"exponent": 10**8}, 60.0))
    cancelled, behind = (asyncio.ensure_future(pool.call(POWER, {"exponent": 10}, 5.0)) for _ in range(2))
    await until(lambda: [len(w.calls) for w in pool.workers] == [3], "the three calls written to the worker")
    [worker] = pool.workers
    cancelled.cancel()  # written, not run yet: its reply will go nowhere, and its worker lives on
    with pytest.raises(asyncio.CancelledError):
        await within(cancelled)
    assert worker.proc.poll() is None and pool.workers == [worker] and len(worker.calls) == 3
    slow.cancel()  # it runs: its worker's state is unknown, so it is killed; the call behind it goes elsewhere
    with pytest.raises(asyncio.CancelledError):
        await within(slow)
    assert pid(await within(behind)) != first and worker.ended and worker not in pool.workers
    assert len(pool.workers) == 1 and not pool._waiting


async def test_a_worker_found_dead_by_the_import_before_a_new_tools_call_fails_the_call_it_ran_not_the_new_one(
        monkeypatch):
    """A busy worker gets a call of a tool it has not imported: the import's request is written first. If that
    write finds the worker dead, the call it was running fails, and the new call goes to another worker."""
    pool = WorkerPool(size=1, depth=8)
    await pool.call(POWER, {"exponent": 10}, 5.0)
    running = asyncio.ensure_future(pool.call(POWER, {"exponent": 10**8}, 60.0))
    await until(lambda: [len(w.calls) for w in pool.workers] == [1], "the slow call running on the worker")
    [worker] = pool.workers
    real_write = worker_pool.write_all

    def broken(stream, data):  # the first import of `refuse` finds its worker dead
        if data == frame(("load", *REFUSE)) and worker.proc.poll() is None:
            worker.proc.kill()
            worker.proc.wait(timeout=5)
            raise BrokenPipeError("the worker is gone")
        real_write(stream, data)

    monkeypatch.setattr(worker_pool, "write_all", broken)
    new = asyncio.ensure_future(pool.call(REFUSE, {"text": "refuse"}, 5.0))
    with pytest.raises(RuntimeError, match=r"^the worker process exited \(status -9\) during the call$"):
        await within(running)
    assert await within(new) == ("refused", "refused 'refuse'") and pool.workers and worker not in pool.workers


async def test_a_worker_that_cannot_start_fails_the_call_with_one_line_and_the_queue_moves_on(monkeypatch):
    pool = WorkerPool(size=1)

    def no_process(self):
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(worker_pool._Worker, "__init__", no_process)
    with pytest.raises(RuntimeError, match=r"^a worker process could not start: \[Errno 11\] Resource"):
        await within(pool.call(MIRROR, {"text": "ab", "times": 1}, 5.0))
    assert not pool._waiting and not pool.workers
    monkeypatch.undo()
    assert await within(pool.call(MIRROR, {"text": "ab", "times": 1}, 5.0)) == ("ok", "ba")
