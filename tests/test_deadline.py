"""core.deadline: asyncio.timeout's behaviour (TimeoutError from its own cancellation, anyone else's left as
it is), never early, at most a slice late, and deadlines of the same slice sharing one timer."""

import asyncio
import math
import time

import pytest
from helpers import until

from agent_rl.core import deadline as deadline_module
from agent_rl.core.deadline import Alarm, deadline, slice_length


def test_slice_length_is_the_largest_power_of_two_within_a_32nd_of_the_timeout():
    assert slice_length(120.0) == 1.0  # 3.75 -> 2, capped at a second
    assert slice_length(32.0) == 1.0
    assert slice_length(31.9) == 0.5
    assert slice_length(1.0) == 2.0**-5
    assert slice_length(0.1) == 2.0**-9  # 0.003125 -> 0.001953125
    assert slice_length(0.01) == 2.0**-10  # below the finest: the finest
    assert slice_length(0.0) == slice_length(-1.0) == slice_length(float("nan")) == 2.0**-10


async def test_an_await_past_its_deadline_ends_in_timeout_error_never_early_and_at_most_a_slice_late():
    for timeout_s in (0.05, 0.2):
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            async with deadline(timeout_s) as d:
                await asyncio.sleep(5)
        took = time.monotonic() - t0
        assert d.expired
        assert timeout_s <= took < timeout_s + slice_length(timeout_s) + 0.05, took
        assert asyncio.current_task().cancelling() == 0  # its own cancellation taken back


async def test_an_await_in_time_returns_and_leaves_nothing_behind():
    loop = asyncio.get_running_loop()
    async with deadline(10.0) as d:
        assert await asyncio.sleep(0.01, result=7) == 7
        assert any(d in members for members in deadline_module._SLICES[loop].values())
    assert not d.expired
    assert not any(d in members for members in deadline_module._SLICES[loop].values())


async def test_a_thousand_deadlines_of_one_length_share_a_timer_or_two():
    loop = asyncio.get_running_loop()  # shared with the session's other tests: their slices may be there already
    before = {k: set(v) for k, v in deadline_module._SLICES.get(loop, {}).items()}
    started, inside = asyncio.Event(), []

    async def one() -> str:
        async with deadline(60.0):
            inside.append(True)
            await started.wait()
            return "done"

    tasks = [asyncio.create_task(one()) for _ in range(1000)]
    await until(lambda: len(inside) == 1000, "the 1000 tasks inside their deadlines")
    slices = deadline_module._SLICES[loop]
    ours = {k: v - before.get(k, set()) for k, v in slices.items()}
    made = {k for k, v in ours.items() if v}
    assert 1 <= len(made) <= 2 and sum(len(ours[k]) for k in made) == 1000
    started.set()
    assert await asyncio.gather(*tasks) == ["done"] * 1000
    assert all(not slices.get(k, set()) - before.get(k, set()) for k in made)  # every one left its slice


async def test_a_cancellation_from_outside_stays_a_cancellation():
    entered = asyncio.Event()

    async def waits() -> None:
        async with deadline(10.0):
            entered.set()
            await asyncio.sleep(5)

    task = asyncio.create_task(waits())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_cancellation_from_outside_at_the_deadline_stays_a_cancellation():
    entered, box = asyncio.Event(), []

    async def waits() -> None:
        async with deadline(10.0) as d:
            box.append(d)
            entered.set()
            await asyncio.sleep(5)

    task = asyncio.create_task(waits())
    await entered.wait()
    box[0]._fire()  # the deadline and someone else cancel the task before it runs again
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert box[0].expired


async def test_nested_deadlines_the_inner_one_fires_and_the_outer_one_goes_on():
    async with deadline(10.0) as outer:
        with pytest.raises(TimeoutError):
            async with deadline(0.02) as inner:
                await asyncio.sleep(5)
        assert await asyncio.sleep(0.01, result="after") == "after"
    assert inner.expired and not outer.expired
    assert asyncio.current_task().cancelling() == 0


async def test_a_body_that_swallows_the_cancellation_ends_normally_and_uncancelled():
    async with deadline(0.01) as d:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            pass
    assert d.expired and asyncio.current_task().cancelling() == 0


async def test_a_deadline_of_zero_less_or_nan_fires_at_the_loops_next_passes():
    for timeout_s in (0.0, -5.0, float("nan")):
        with pytest.raises(TimeoutError):
            async with deadline(timeout_s):
                await asyncio.sleep(1)


async def test_none_and_inf_never_fire():
    for timeout_s in (None, float("inf")):
        async with deadline(timeout_s) as d:
            await asyncio.sleep(0.01)
        assert not d.expired


async def test_entered_twice_or_outside_a_task_is_an_error():
    d = deadline(1.0)
    async with d:
        pass
    with pytest.raises(RuntimeError, match="entered once"):
        async with d:
            pass
    loop = asyncio.get_running_loop()
    with pytest.raises(RuntimeError, match="inside a task"):  # a callback of the loop, not a task
        await loop.run_in_executor(None, lambda: asyncio.run(_enter_in_a_callback()))


async def _enter_in_a_callback() -> None:
    loop, done = asyncio.get_running_loop(), asyncio.get_running_loop().create_future()

    def callback() -> None:
        coro = deadline(1.0).__aenter__()
        try:
            coro.send(None)
        except BaseException as e:  # the error comes out of the first step
            done.set_exception(e)

    loop.call_soon(callback)
    await done


async def test_an_alarm_calls_back_once_past_its_time_unless_cancelled_even_by_another_alarm_of_its_slice():
    loop = asyncio.get_running_loop()
    fired: list[tuple[int, float]] = []
    t0 = loop.time()
    alarms = [Alarm(loop, 0.05, lambda k=k: fired.append((k, loop.time() - t0))) for k in range(100)]
    alarms[0].cancel()
    Alarm(loop, math.inf, lambda: fired.append((-1, 0.0)))  # never
    seen: list[set[int]] = []

    def cancel_all() -> None:  # in the same slice: some of the 100 have fired before it, the rest never will
        seen.append({k for k, _ in fired})
        for alarm in alarms:
            alarm.cancel()

    Alarm(loop, 0.05, cancel_all)
    errors: list[dict] = []  # what a callback raised: the loop logs it and goes on, so the test asks for it
    handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: errors.append(context))
    try:
        await asyncio.sleep(0.15)  # the alarms' 0.05 s, then a window in which a cancelled one would fire
    finally:
        loop.set_exception_handler(handler)
    assert not errors and len(seen) == 1 and {k for k, _ in fired} == seen[0] and 0 not in seen[0]
    assert len(fired) == len(seen[0])  # each at most once
    assert all(0.05 <= at < 0.15 for _, at in fired)  # never early, at most a slice (~1.6 ms here) late
