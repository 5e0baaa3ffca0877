"""A tool call never freezes the run: deadlines hold and the event loop keeps ticking.

Each test runs a ticker task beside the tool call and checks the largest gap between its ticks
(it asks to wake every 10 ms; 1 s leaves room for a loaded 2-core machine forking a worker, while the frozen loop
this guards against went 18 s without a tick).
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time

import pytest
import slow_tools
from helpers import until

from agent_rl.core.types import Message, ToolCall
from agent_rl.envs.calculator import CalculatorEnv, calculator
from agent_rl.tools import worker_pool
from agent_rl.tools.base import Tool, tool_options

MAX_GAP_S = 1.0


class Ticker:
    """A task that wakes every 10 ms and records the largest gap between two wake-ups."""

    async def __aenter__(self):
        self.max_gap, self._task = 0.0, asyncio.create_task(self._tick())
        return self

    async def _tick(self):
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            self.max_gap, last = max(self.max_gap, now - last), now

    async def __aexit__(self, *exc):
        self._task.cancel()


async def timed(coro):
    t0 = time.perf_counter()
    out = await coro
    return out, time.perf_counter() - t0


async def test_a_calculator_call_that_would_take_hours_answers_at_once_and_the_loop_ticks():
    env = CalculatorEnv({"id": "t", "question": "?", "answer": 1})
    async with Ticker() as ticker:
        first = await env.step(Message("assistant", "", (ToolCall("calculator", {"expression": "2 + 3"}),)), 0)
        for expression in ("(((9**64)**64)**64)**64", "((((9**64)**64)**64)**64)**64", "*".join(["9**64"] * 20)):
            reply = Message("assistant", "", (ToolCall("calculator", {"expression": expression}),))
            result, seconds = await timed(env.step(reply, 1))
            assert seconds < 2.0, expression
            assert result.messages[0].content == "Error: result too large (limit 1000 digits)"
            assert not result.tool_calls[0].ok and not result.done
    assert first.messages[0].content == "5"  # the first call started the worker process
    assert ticker.max_gap < MAX_GAP_S


async def test_a_gil_holding_tool_in_a_worker_is_killed_at_its_deadline():
    tool = Tool(slow_tools.big_power, timeout_s=1.0, isolate=True)
    async with Ticker() as ticker:
        warm = await tool.call({"exponent": 10})
        pid = int(warm.content.split()[1].rstrip(":"))
        result, seconds = await timed(tool.call({"exponent": 10**8}))  # minutes of one C call
        assert seconds < 4.0  # the 1 s deadline plus the kill: 2.3 s once on a loaded CI machine, far from minutes
        assert result.content == "Error: big_power did not finish within 1 s" and not result.ok
        again = await tool.call({"exponent": 10})
    assert gone(pid)  # killed at the deadline
    assert warm.content.endswith("29 bits") and again.ok and again.content != warm.content  # a fresh worker
    assert ticker.max_gap < MAX_GAP_S


def gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether process `pid` has ended (killed, then reaped by a background thread) within `within_s`."""
    deadline = time.monotonic() + within_s
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.02)
    return not os.path.exists(f"/proc/{pid}")


async def test_a_cancelled_call_kills_its_worker():
    tool = Tool(slow_tools.big_power, isolate=True)
    pid = int((await tool.call({"exponent": 10})).content.split()[1].rstrip(":"))
    [worker] = [w for w in worker_pool._POOLS[asyncio.get_running_loop()].workers if w.proc.pid == pid]
    task = asyncio.create_task(tool.call({"exponent": 10**8}))
    await until(lambda: worker.calls, "the slow call running on the warm worker")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gone(pid)


async def test_a_slow_pure_python_tool_in_a_thread_is_stopped_at_its_deadline():
    tool = Tool(slow_tools.spin, timeout_s=0.5)
    assert not tool.isolate
    async with Ticker() as ticker:
        result, seconds = await timed(tool.call({"seconds": 60.0}))
        await until(lambda: "tool spin" not in {t.name for t in threading.enumerate()}, "the spin thread ended")
        stopped_at = slow_tools.progress[0]
        await asyncio.sleep(0.3)  # a window in which a thread still running would move on: that it did not is checked
    assert seconds < 2.0 and result.content == "Error: spin did not finish within 0.5 s"
    assert slow_tools.progress[0] == stopped_at > 0  # the thread no longer runs
    assert ticker.max_gap < MAX_GAP_S
    assert (await tool.call({"seconds": 0.01})).content == "done"


async def test_worker_failures_become_tool_messages():
    tool = Tool(slow_tools.refuse, isolate=True)
    assert (await tool.call({"text": "refuse"})).content == "Error: refused 'refuse'"
    assert (await tool.call({"text": "fail"})).content == "Error: refuse failed: ValueError: a bug in the tool"
    assert (await tool.call({"text": "exit"})).content == (
        "Error: refuse failed: RuntimeError: the worker process exited (status 3) during the call")
    assert (await tool.call({"text": "refuse"})).content == "Error: refused 'refuse'"  # a fresh worker
    assert (await tool.call({"nope": 1})).content.startswith(
        "Error: invalid arguments for refuse: text: Field required")


async def test_messages_larger_than_a_pipe_buffer_arrive_whole_and_small_calls_start_no_thread():
    """The worker's pipes are served by the event loop (worker_pool._Worker): a 300 KB request (written from a
    thread: the pipe holds 64 KiB) and a 1.2 MB reply arrive whole, in order, beside small calls, and the loop
    keeps ticking; calls with small requests start no thread at all."""
    tool = Tool(slow_tools.mirror, isolate=True)
    assert (await tool.call({"text": "ab", "times": 1})).content == "ba"  # the workers are up
    await asyncio.gather(*(tool.call({"text": "ab", "times": 1}) for _ in range(2 * worker_pool.POOL_SIZE)))
    threads = {t.ident for t in threading.enumerate()}
    small = await asyncio.gather(*(tool.call({"text": f"{i}x", "times": 2}) for i in range(20)))
    assert [r.content for r in small] == [f"{i}x"[::-1] * 2 for i in range(20)]
    assert {t.ident for t in threading.enumerate()} == threads
    text = "".join(chr(0x41 + i % 26) for i in range(300_000))
    async with Ticker() as ticker:
        big_request, big_reply, tiny = await asyncio.gather(
            tool.call({"text": text, "times": 1}), tool.call({"text": "xyz", "times": 400_000}),
            tool.call({"text": "12", "times": 3}))
    assert big_request.content == text[::-1] and big_reply.content == "zyx" * 400_000 and tiny.content == "212121"
    assert ticker.max_gap < MAX_GAP_S


def test_only_importable_sync_functions_can_be_isolated():
    def local(x: int) -> int:
        return x

    async def coroutine(x: int) -> int:
        return x

    class Env:
        def act(self, x: int) -> int:
            return x

    for fn in (local, lambda x: x, Env().act):
        with pytest.raises(TypeError, match="cannot run in a worker process: it must be a module-level function"):
            Tool(fn, name="f", isolate=True)
    with pytest.raises(TypeError, match="isolate=True is for synchronous functions"):
        Tool(coroutine, isolate=True)
    assert (Tool(calculator).isolate, Tool(calculator).timeout_s) == (True, 5.0)  # its tool_options
    assert (Tool(calculator, isolate=False, timeout_s=1.0).isolate, Tool(slow_tools.spin).isolate) == (False, False)
    assert tool_options(isolate=True)(local) is local and local.__tool_options__ == {"isolate": True}


def test_a_finished_event_loop_takes_its_worker_processes_with_it():
    tool = Tool(slow_tools.big_power, isolate=True)

    async def contended():  # more calls than slots, so that some wait for one
        return await asyncio.gather(*(tool.call({"exponent": 10}) for _ in range(2 * worker_pool.POOL_SIZE)))

    pids = {int(r.content.split()[1].rstrip(":")) for r in asyncio.run(contended())}
    assert len(pids) == worker_pool.POOL_SIZE
    gc.collect()
    assert all(gone(pid) for pid in pids)


async def test_a_worker_that_dies_while_idle_is_replaced_and_the_loop_stops_watching_it():
    """The loop watches a worker's stdout from its first call on (worker_pool._Worker): when the worker dies
    between calls, the loop reads its end and stops watching the pipe, and the next call gets a fresh worker."""
    tool = Tool(slow_tools.big_power, isolate=True)
    pid = int((await tool.call({"exponent": 10})).content.split()[1].rstrip(":"))
    loop = asyncio.get_running_loop()
    pool = worker_pool._POOLS[loop]
    [dead] = [w for w in pool.workers if w.proc.pid == pid]
    watched = lambda: {key.fd for key in loop._selector.get_map().values()}  # noqa: E731
    assert dead._out in watched()
    os.kill(pid, 9)
    await until(lambda: dead.ended, "the loop reading the dead worker's end")
    assert dead._out not in watched()
    reply = (await tool.call({"exponent": 10})).content
    fresh_pid = int(reply.split()[1].rstrip(":"))
    assert reply.endswith(": 29 bits") and fresh_pid != pid and dead not in pool.workers
    [fresh] = [w for w in pool.workers if w.proc.pid == fresh_pid]
    assert fresh._out in watched()
