"""bench/runner_scale.py --workers at a small scale (bench/shared/sim_remote.py): the simulation in a Ray actor of its
own, reached over TCP by every worker, answers with the latency model of the in-process one; real calculator
episodes play on 2 rollout workers through it; one measurement gives tokens/s and each process's CPU per turn."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is not installed: the checkout's

from bench.shared.sim_servers import GpuModel


async def test_the_shared_simulation_answers_over_tcp_with_the_model_time(ray_local):
    import ray

    from bench.shared.sim_remote import SimClient, SimService

    gpu = GpuModel(step_base_s=0.002, step_per_seq_s=0.0005, prefill_tok_s=1e9, max_seqs=4, overhead_s=0.0)
    sim = ray.remote(SimService).options(num_cpus=0).remote()
    address = await sim.start.remote(1, {k: getattr(gpu, k) for k in gpu.__dataclass_fields__}, "least", 0)
    client = SimClient(tuple(address))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await asyncio.gather(*(client.generate(f"c{i}", 10, 50) for i in range(5)))
    took = loop.time() - t0
    counts, cpu = await sim.snapshot.remote()
    ray.kill(sim)
    # 4 run together (50 steps of 4 ms), the fifth after them alone (50 of 2.5 ms): as in-process
    assert 50 * gpu.step_s(4) + 50 * gpu.step_s(1) - 1e-3 <= took < 50 * gpu.step_s(4) + 50 * gpu.step_s(1) + 1.0
    assert counts == (5, 250, 50, 50) and cpu > 0


async def test_a_worker_measurement_plays_real_episodes_on_2_workers(ray_local):
    from bench.runner_scale import measure_workers
    from bench.shared.sim_episodes import Workload

    fast = GpuModel(step_base_s=0.001, step_per_seq_s=0.0001, prefill_tok_s=1e6, max_seqs=4, overhead_s=0.001)
    work = Workload(turns=3, min_tokens=20, max_tokens=60, group_size=4)
    row = await measure_workers(2, 2, 32, fast, work, "smollm2-135m", warmup=2.0, window=2.0, routing="sticky",
                                shared=0)
    assert row["workers"] == 2 and row["workers_up"] == 2
    assert row["tok_s"] > 0 and row["turns_s"] > 0 and row["window_s"] >= 2.0
    assert row["cpu_ms_per_turn"] > 0 and row["driver_cpu_ms_per_turn"] > 0 and row["sim_cpu_ms_per_turn"] > 0
    assert 0 < row["prefix_hit"] <= 1  # later turns find their conversation's context cached, across processes
