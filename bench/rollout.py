"""Rollout efficiency: sampled tokens/s of multi-turn rollouts with 100 ms tools vs raw vLLM generation.

One vLLM server, one run, alternating the two sides `--reps` times (machines are noisy: we report
the ratio of medians). The runner side plays `--episodes` concurrent episodes of `--turns` turns;
after each turn a tool sleeps `--tool-ms`. The raw side sends one request per episode asking for
exactly the number of tokens that episode sampled (ignore_eos + min_tokens), all at once.

    python bench/rollout.py [--model smollm2-135m | --server-url URL]

Prints one JSON line: rollout_tok_s, raw_tok_s, rollout_efficiency (target >= 0.90), ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402

from agent_rl.core.renderers import load_renderer  # noqa: E402
from agent_rl.core.types import Message  # noqa: E402
from agent_rl.learn.models import resolve_model  # noqa: E402
from agent_rl.rollout.runner import EpisodeLimits, rollout_groups  # noqa: E402
from agent_rl.rollout.sampler import VLLMSampler  # noqa: E402
from agent_rl.rollout.server import VLLMServer, attach  # noqa: E402
from envs.base import Env, StepResult  # noqa: E402


class SlowToolEnv(Env):
    """Every assistant turn is followed by a tool that takes `tool_s` seconds."""

    def __init__(self, task: dict, turns: int, tool_s: float):
        self.task, self.turns, self.tool_s = task, turns, tool_s

    async def initial_messages(self):
        return [Message("user", f"Tell me a short fact about the number {self.task['n']}.")]

    async def step(self, reply, turn):
        if turn + 1 >= self.turns:
            return StepResult(done=True)
        await asyncio.sleep(self.tool_s)
        return StepResult(messages=(Message("tool", f"fact #{turn}: {self.task['n'] * (turn + 2)}", name="facts"),))

    async def reward(self, messages):
        return 0.0


async def runner_side(url, renderer, args):
    tasks = [{"id": str(i), "n": i} for i in range(args.episodes)]
    limits = EpisodeLimits(max_turns=args.turns, max_tokens_per_turn=args.tokens_per_turn,
                           max_total_tokens=4096, temperature=1.0)
    async with VLLMSampler([url]) as sampler:
        t0 = time.perf_counter()
        groups = await rollout_groups(tasks, lambda t: SlowToolEnv(t, args.turns, args.tool_ms / 1000),
                                      sampler, renderer, limits, group_size=1, max_concurrent=args.episodes)
        dt = time.perf_counter() - t0
    trajs = [g.trajectories[0] for g in groups]
    errors = [t.error for t in trajs if t.error]
    if errors:
        raise SystemExit(f"error: rollout failed: {errors[0]}")
    return [t.num_sampled for t in trajs], [list(t.token_ids[: t.prompt_len]) for t in trajs], dt


async def raw_side(url, prompts, budgets):
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async def one(prompt, n):
            body = {"model": "base", "prompt": prompt, "max_tokens": n, "min_tokens": n, "ignore_eos": True,
                    "temperature": 1.0, "logprobs": 0, "return_token_ids": True}
            async with http.post(url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                return len((await r.json())["choices"][0]["token_ids"])

        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, budgets)))
        return sum(got), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--server-url")
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens-per-turn", type=int, default=48)
    ap.add_argument("--tool-ms", type=float, default=100.0)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    renderer = load_renderer(model_dir)
    server = None
    if args.server_url:
        url = attach(args.server_url)
    else:
        server = VLLMServer(model_dir, kv_cache_gib=2.0, max_model_len=4096).start()
        url = server.url
    try:
        # warm-up (compilation, prefix cache of the system prompt)
        asyncio.run(runner_side(url, renderer, argparse.Namespace(**{**vars(args), "episodes": 4, "turns": 1})))
        rollout_rates, raw_rates, tokens = [], [], []
        for _ in range(args.reps):
            budgets, prompts, dt = asyncio.run(runner_side(url, renderer, args))
            rollout_rates.append(sum(budgets) / dt)
            tokens.append(sum(budgets))
            n_raw, dt_raw = asyncio.run(raw_side(url, prompts, budgets))
            raw_rates.append(n_raw / dt_raw)
    finally:
        if server:
            server.stop()
    rollout, raw = statistics.median(rollout_rates), statistics.median(raw_rates)
    print(json.dumps({
        "bench": "rollout", "model": args.model, "episodes": args.episodes, "turns": args.turns,
        "tool_ms": args.tool_ms, "sampled_tokens_per_rep": tokens, "rollout_tok_s": round(rollout, 1),
        "raw_tok_s": round(raw, 1), "rollout_efficiency": round(rollout / raw, 3),
        "rollout_tok_s_reps": [round(x, 1) for x in rollout_rates], "raw_tok_s_reps": [round(x, 1) for x in raw_rates],
    }))


if __name__ == "__main__":
    main()
