"""bench/deadlines.py times what it says: every side's awaits run and finish inside their deadline, the live
timers it adds are gone after a row, and a row's own figures are the side's less the bare await's."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is not installed: the checkout's

from bench.deadlines import SIDES, measure, one_round


async def test_each_side_runs_its_awaits_in_a_deadline_of_its_kind():
    entered = []
    for side, make in SIDES.items():
        cm = make(120.0)
        async with cm:
            entered.append((side, type(cm).__name__))
    assert entered == [("bare", "_NoDeadline"), ("asyncio", "Timeout"), ("deadline", "Deadline")]
    for side in SIDES:
        assert 0 < await one_round(side, tasks=8, passes=3) < 0.01


def test_a_row_subtracts_the_bare_await_and_leaves_no_timer_behind():
    async def row_and_timers():
        row = await measure(tasks=16, live=50, rounds=2, passes=3)
        loop = asyncio.get_running_loop()
        return row, sum(not h.cancelled() for h in loop._scheduled)

    row, left = asyncio.run(row_and_timers())
    assert row["live"] == 50 and left <= 2  # at most the deadlines' own slice timers, still to fire
    for side in ("asyncio", "deadline"):
        assert abs(row[f"{side}_own_us"] - (row[f"{side}_us"] - row["bare_us"])) < 2e-3  # each rounded apart
    assert row["bare_us"] > 0 and row["asyncio_us"] > 0 and row["deadline_us"] > 0
