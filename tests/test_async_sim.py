"""bench/async_sim.py at a small scale: the simulated clock jumps over waits, the simulated servers count
their busy seconds, and one run of the real loop per staleness (and at k = 2 with one step sampled ahead) keeps its
lag within the bound."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import time
from pathlib import Path

from agent_rl.learn.models import resolve_model

_spec = importlib.util.spec_from_file_location("async_sim",
                                               Path(__file__).resolve().parents[1] / "bench" / "async_sim.py")
sim = importlib.util.module_from_spec(_spec)
sys.modules["async_sim"] = sim  # dataclasses look their module up
_spec.loader.exec_module(sim)  # puts the repository on sys.path: bench.* import below
from bench.shared import sim_clock  # noqa: E402
from bench.shared.sim_servers import GpuModel, SimCluster  # noqa: E402

FAST = GpuModel(step_base_s=0.01, step_per_seq_s=0.0, prefill_tok_s=1e9, max_seqs=4, overhead_s=0.0)


def test_the_simulated_clock_jumps_over_an_hour():
    async def main():
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3600.0)
        await asyncio.wait_for(asyncio.sleep(1.5), timeout=10.0)
        return loop.time()

    t0 = time.perf_counter()
    assert sim_clock.run(main()) == 3601.5
    assert time.perf_counter() - t0 < 5.0


def test_busy_seconds_count_work_and_leave_out_gaps():
    async def main():
        cluster = SimCluster(1, FAST)
        await cluster.generate(object(), 10, 50)  # 50 decode steps of 10 ms: 0.5 s busy
        await asyncio.sleep(5.0)  # idle
        await asyncio.gather(cluster.generate(object(), 10, 20), cluster.generate(object(), 10, 20))
        busy = cluster.busy_s()  # both together: 20 steps, 0.2 s
        cluster.close()
        return busy, asyncio.get_running_loop().time()

    busy, now = sim_clock.run(main())
    assert abs(busy - 0.7) < 1e-6
    assert abs(now - 5.7) < 1e-6


def _args(steps: int) -> argparse.Namespace:
    return argparse.Namespace(tail=sim.Tail(max_turns=3, median_tokens=40), gpu=FAST, steps=steps, warm=1,
                              train_tok_s=8200.0, trainer_gpus_per_server=0.5, push_s=2.0, seed=0)


def test_one_server_runs_the_real_loop_within_the_bound(renderer):
    smol = resolve_model("smollm2-135m")
    rows = {(k, drain, ahead): sim_clock.run(sim.measure(1, k, drain, _args(5), renderer, smol, ahead))
            for k, drain, ahead in ((0, False, None), (2, False, None), (2, True, None), (2, False, 1.0))}
    rows = {key[:2] if key[2] is None else key: row for key, row in rows.items()}
    sync = rows[0, False]
    assert sync["lag_mean"] == 0.0 and sync["lag_max"] == 0.0
    assert sync["episodes_in_flight_at_push"] == 0.0  # the synchronous loop pushes with nothing playing
    for drain in (False, True):
        row = rows[2, drain]
        assert 0.0 <= row["lag_mean"] <= row["lag_max"] <= 2.0
        assert row["trained_tok_s"] > 0 and 0.0 <= row["idle_share"] <= 1.0
    assert rows[2, True]["wait_s"] <= rows[2, False]["wait_s"]  # the drain is the push's time, not a wait
    assert [rows[key]["sample_ahead"] for key in ((0, False), (2, False), (2, False, 1.0))] == [0.0, 2.0, 1.0]
    assert 0.0 <= rows[2, False, 1.0]["lag_mean"] <= rows[2, False, 1.0]["lag_max"] <= 2.0
