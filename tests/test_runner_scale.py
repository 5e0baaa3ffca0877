"""bench/runner_scale.py at a small scale: the simulated servers keep their latency model, the
simulated sampler drives real calculator episodes through the real runner, and one measurement
pair yields its share and lag figures. Fast servers (about 1 ms a decode step) keep it to seconds."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from agent_rl.core.types import StopReason
from agent_rl.envs.calculator import CalculatorEnv, arithmetic_tasks
from agent_rl.rollout.engine import rollout_groups
from agent_rl.rollout.runner import EpisodeLimits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is not installed: the checkout's

import bench.runner_scale as rs
from bench.shared.sim_episodes import SimSampler, Workload, calculator_env
from bench.shared.sim_responses import LOGPROBS, response_json, token_pieces
from bench.shared.sim_servers import GpuModel, SimCluster

FAST = GpuModel(step_base_s=0.001, step_per_seq_s=0.0001, prefill_tok_s=1e6, max_seqs=4, overhead_s=0.001)
SHORT = Workload(turns=3, min_tokens=20, max_tokens=60, group_size=4)


async def test_a_full_batch_takes_the_model_time_and_one_more_waits():
    gpu = GpuModel(step_base_s=0.002, step_per_seq_s=0.0005, prefill_tok_s=1e9, max_seqs=4, overhead_s=0.0)
    cluster = SimCluster(1, gpu)
    loop = asyncio.get_running_loop()
    done = {}

    async def one(i):
        await cluster.generate(object(), 10, 50)
        done[i] = loop.time()

    t0 = loop.time()
    await asyncio.gather(*(one(i) for i in range(5)))
    cluster.close()
    batch_s = 50 * gpu.step_s(4)  # 4 running: 50 steps of 4 ms
    assert all(done[i] - t0 >= batch_s - 1e-3 for i in range(4))
    assert done[4] - t0 >= batch_s + 50 * gpu.step_s(1) - 1e-3  # waited for a slot, then ran alone
    assert done[4] - t0 < batch_s + 50 * gpu.step_s(1) + 1.0  # and nothing else held it up
    assert cluster.snapshot() == (5, 250, 50, 50)  # requests, output tokens, prefilled, prompt tokens


async def test_the_simulated_sampler_plays_real_calculator_episodes(renderer):
    cluster = SimCluster(1, FAST)  # one server: every later turn finds its context cached
    sampler = SimSampler(cluster, renderer, SHORT)
    limits = EpisodeLimits(max_turns=4, max_tokens_per_turn=1024, max_total_tokens=8192, seed=0)
    t0 = time.perf_counter()
    groups = await rollout_groups(arithmetic_tasks(3), CalculatorEnv, sampler, renderer, limits, group_size=2)
    cluster.close()
    assert time.perf_counter() - t0 < 30
    trajectories = [t for g in groups for t in g.trajectories]
    assert len(trajectories) == 6
    for t in trajectories:
        assert t.error is None and t.stop_reason is StopReason.NO_TOOL_CALL
        assert len(t.turns) == 3 and [c.ok for c in t.tool_calls] == [True, True]  # the real tool ran twice
        assert t.reward == 1.0  # the answer is the tool's result, graded by the env
        for turn in t.turns:  # sampled ids: mask 1, the sampler's log-probs
            assert set(t.loss_mask[turn.start:turn.end]) == {1}
            assert t.logprobs[turn.start:turn.end] == tuple(LOGPROBS[:turn.end - turn.start])
    assert cluster.requests == 18
    assert 0 < cluster.prefill < cluster.prompt_tokens / 2  # only the new tokens of later turns are prefilled


def test_the_stand_in_response_is_what_vllm_writes(renderer):
    """Field for field what a real vLLM 0.32 server wrote for VLLMSampler's request (tests/test_integration_vllm.py
    checks the same keys against the real one): the text is the ids' text, each token's offset and text."""
    import orjson

    ids = renderer.encode("Hello world, let me think")
    choice = orjson.loads(response_json([1, 2, 3], ids, token_pieces(renderer)))["choices"][0]
    assert list(choice) == ["index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_logprobs",
                            "prompt_token_ids", "routed_experts"]
    logprobs = choice["logprobs"]
    assert choice["text"] == "Hello world, let me think" and choice["token_ids"] == ids
    assert "".join(logprobs["tokens"]) == choice["text"]
    tokens = logprobs["tokens"]
    assert logprobs["text_offset"] == [len("".join(tokens[:k])) for k in range(len(tokens))]
    assert logprobs["top_logprobs"] == [{t: p} for t, p in zip(logprobs["tokens"], logprobs["token_logprobs"])]
    assert choice["prompt_token_ids"] == [1, 2, 3]


async def test_a_measurement_pair_gives_share_and_lag(renderer):
    row = await rs.measure_pair(2, 32, FAST, SHORT, renderer, warmup=1.0, window=2.0)
    assert row["runner_tok_s"] > 0 and row["ideal_tok_s"] > 0
    # 32 episodes on 8 slots: the servers are the bottleneck for both sides, so the runner's share
    # is near 1 on an idle machine; the bounds only allow for a busy one
    assert 0.3 < row["share"] < 1.5
    assert 0 <= row["p99_lag_ms"] <= row["max_lag_ms"] < 5000
    assert row["cpu_ms_per_turn"] > 0 and 0 <= row["prefix_hit"] <= 1 and row["window_s"] >= 2.0
    assert 0 < row["server_work_ms_per_turn"] < row["cpu_ms_per_turn"]  # the servers' work, timed on each side,
    assert 0 < row["ideal_server_work_ms_per_turn"] < row["ideal_cpu_ms_per_turn"]  # is left out of both
    own = (row["cpu_ms_per_turn"] - row["server_work_ms_per_turn"]
           - (row["ideal_cpu_ms_per_turn"] - row["ideal_server_work_ms_per_turn"]))
    assert abs(row["own_cpu_ms_per_turn"] - own) <= 0.003


def test_the_runner_side_alone_gives_its_cpu_per_turn_at_each_scale(renderer):
    import argparse

    args = argparse.Namespace(servers=[2], concurrency=[16, 32], warmup=0.5, window=1.0, routing="sticky")
    out = rs.runner_only(args, FAST, SHORT, renderer)
    assert out["runner_only"] and [(r["servers"], r["concurrency"]) for r in out["rows"]] == [(2, 16), (2, 32)]
    for row in out["rows"]:
        assert row["cpu_ms_per_turn"] > 0 and row["turns_s"] > 0 and row["window_s"] >= 1.0
        assert "share" not in row  # no ideal client was run


async def test_the_calculator_in_the_loop_is_the_same_tool_to_the_model():
    task = arithmetic_tasks(1)[0]
    shipped, in_loop = calculator_env(task, "worker"), calculator_env(task, "loop")
    assert shipped.tools[0].isolate and in_loop.tools[0].is_async  # one in its worker process, one in the loop
    assert in_loop.tool_schemas == shipped.tool_schemas  # the same prompt: the same tokens rendered
    call = {"expression": "(123 + 456) * 789 / 3"}
    got = [await env.tools[0].call(call) for env in (shipped, in_loop)]
    assert got[0] == got[1] and got[0].ok and got[0].content == "152277"
    assert Workload().calculator == "worker"  # as shipped unless asked
