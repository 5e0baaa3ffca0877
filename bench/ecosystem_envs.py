"""What the verifiers and OpenEnv adapters cost an episode, against a native environment, without a model.

Owns: timing only; ends with one JSON line on stdout. The same 3-turn, 2-call episode
(tests/test_rollout_tokens.py's "2+3+4?" with an `add` tool, the same tokens) played by the native `ToolEnv` and by
the verifiers taskset tests/vf_add_taskset.py (its `run()`, toolset and scoring), through the rollout runner with a
scripted sampler and the SmolLM2 renderer, 16 episodes at once; then the OpenEnv guessing game of
examples/openenv_guess served from its folder (its start-up timed) and played by its folder's scripted solver, one
WebSocket session per episode.
Usage: python bench/ecosystem_envs.py [--episodes 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import test_rollout_tokens as tokens  # noqa: E402

from agent_rl.core.renderers.choose import load_renderer  # noqa: E402
from agent_rl.envs import openenv_env, verifiers_env  # noqa: E402
from agent_rl.learn.models import resolve_model  # noqa: E402
from agent_rl.rollout.engine import rollout_groups  # noqa: E402
from agent_rl.rollout.runner import EpisodeLimits  # noqa: E402
from agent_rl.rollout.scripted import ScriptedSampler  # noqa: E402

GUESS = str(ROOT / "examples" / "openenv_guess")


async def per_episode(rows, make_env, script, renderer) -> float:
    sampler = ScriptedSampler(renderer, script, on_messages=True)
    t0 = time.perf_counter()
    groups = await rollout_groups(rows, make_env, sampler, renderer, EpisodeLimits(), group_size=1, max_concurrent=16)
    seconds = time.perf_counter() - t0
    failed = [g.trajectories[0].error for g in groups if g.trajectories[0].infra_error]
    assert not failed, failed[0]
    return seconds / len(rows)


def add_script(messages):
    return [tokens.CALL_1, tokens.CALL_2, tokens.ANSWER][sum(m.role == "tool" for m in messages)]


async def main(n: int) -> dict[str, float]:
    renderer = load_renderer(resolve_model("smollm2-135m"))
    vf_rows = verifiers_env.load_tasks(n, taskset="vf_add_taskset")
    await per_episode(vf_rows[:4], verifiers_env.make_env, add_script, renderer)  # imports, first loads
    native = await per_episode([{"id": f"n{i}"} for i in range(n)], lambda task: tokens.AddEnv(), add_script, renderer)
    vf = await per_episode(vf_rows, verifiers_env.make_env, add_script, renderer)
    t0 = time.perf_counter()
    await openenv_env.local_server(GUESS)
    start = time.perf_counter() - t0
    oe_rows = openenv_env.load_tasks(n, path=GUESS)
    oe = await per_episode(oe_rows, openenv_env.make_env, lambda m: openenv_env.solve(oe_rows[0], m), renderer)
    return {"episodes": n, "native_ms_per_episode": round(native * 1e3, 2),
            "verifiers_ms_per_episode": round(vf * 1e3, 2), "openenv_server_start_s": round(start, 1),
            "openenv_ms_per_episode": round(oe * 1e3, 2)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    print(json.dumps(asyncio.run(main(parser.parse_args().episodes))))
