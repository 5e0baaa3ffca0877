"""Runner at scale: the real async runner against simulated GPU servers, 256 to 8,192 episodes at once.

Owns: a sampler that answers through simulated servers with real token ids (`SimSampler`), a
zero-overhead client of the same servers (`ideal_load`), and the measurement of both side by side
(`measure_pair`) with the event loop's lag and the process's CPU time.
Does not own: the server model (bench/sim_servers.py), nor the runner, renderer, environment or
tool: those are the real ones (`rollout_groups`, the SmolLM2 ChatML renderer, `envs.calculator`).

What runs for real: every episode is a `CalculatorEnv` played by `rollout_groups`; each reply is
real token ids (filler "thinking" + a `<tool_call>` or an `<answer>`) that the runner parses, the
env dispatches to the real tool, and the renderer continues; the sampler also does VLLMSampler's
client-side work (the request's JSON, written as VLLMSampler writes it; the response's JSON read and checked
as VLLMSampler reads it), not the socket I/O. The response's JSON is written in this process (the server's
work), so the ideal client writes one of the same size each turn too. Making the replies is the servers' work:
their endings are encoded once per text.

Share: the runner's sampled tokens/s over what a zero-overhead client (the same episode lengths;
no tokenizer, env or tool) gets from identical servers at the same concurrency, each over the same
window after a warm-up. Target: >= 0.95 and an event-loop lag under 50 ms at 4,096 concurrent
episodes. CPU per turn: `cpu_ms_per_turn` is the runner process's, the simulation's work included;
`own_cpu_ms_per_turn` subtracts the ideal client's (which pays the same simulation and nothing else): the
runner's own. The servers' work in this process is timed apart on both sides (`server_work_ms_per_turn`) and
left out of both before the subtraction: writing each response's JSON, their largest, which in the runner's
process, whose caches hold thousands of episodes, costs more than in the ideal client's (that difference is the
simulation's, not the runner's); choosing each reply; and on the runner's side only, which reply it is and the
fingerprints of a context's ids the prefix cache compares (work a server does and the ideal client has no use
for: its lengths come from the same draw, its contexts are never compared).

Routing is "sticky" by default: with VLLMSampler's least-outstanding rule ("least") a client with no think time
at all keeps landing on the server it just left (the slot it freed is the least loaded) and so keeps its prefix
cache, which no agent with tools can do; the share would then measure that, not the runner. `--routing least`
shows what the rule costs.

Garbage collection: `gc_in_window_ms` is the longest collection inside the window (the runner turns
automatic collection off while episodes run: `rollout.quiet_gc`), `gc_after_ms` the longest
after it: the one collection the runner makes when a rollout ends (here when the window's episodes are
cancelled; in training once per step, when no episode of the step is left in flight).

    python bench/runner_scale.py [--servers 8 64] [--concurrency 256 1024 4096 8192] [--routing least]
    python bench/runner_scale.py --workers 1 2 4 --servers 64 128 --concurrency 8192 16384  (Ray rollout workers)
    python bench/runner_scale.py --runner-only --servers 64 --concurrency 4096 8192  (the runner's CPU per turn alone)
    python bench/runner_scale.py ... --calculator loop  (the calculator called in the event loop, not its worker)
(progress on stderr, one JSON line on stdout)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import random
import resource
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_rl.core.renderers.base import Renderer
from agent_rl.core.renderers.choose import load_renderer
from agent_rl.core.types import Message, ToolCall
from agent_rl.envs.base import ToolEnv
from agent_rl.envs.calculator import SYSTEM, CalculatorEnv, arithmetic_tasks, calculator
from agent_rl.learn.models import resolve_model
from agent_rl.rollout.engine import rollout_groups
from agent_rl.rollout.quiet_gc import ROLLOUT_GC
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.rollout.sampler import Completion, SamplingParams
from agent_rl.rollout.serving.vllm.sampler import read_response, request_body, response_completion
from bench.loop_meters import CollectionTimes, LagMeter, page_faults, run_queue_s
from bench.sim_responses import Responses, ServerWork, token_pieces
from bench.sim_servers import GpuModel, SimCluster

FILLER = ("Let me think about this step by step. First I read the question again, then I decide which "
          "tool helps, what arguments it needs, and how I will check the result before I answer. ")


@dataclass(frozen=True)
class Workload:
    """Episode shape: `turns` replies (all but the last call the calculator), filler tokens per reply; where the
    runner's calculator runs: "worker" (its own process, as shipped) or "loop" (called in the event loop, the
    same function and schema: what a turn costs the runner without the isolated tool path)."""

    turns: int = 3
    min_tokens: int = 96
    max_tokens: int = 416
    group_size: int = 8
    calculator: str = "worker"


async def calculator_in_loop(expression: str) -> str:
    return calculator(expression)


calculator_in_loop.__name__, calculator_in_loop.__doc__ = calculator.__name__, calculator.__doc__


def calculator_env(task: dict[str, Any], where: str) -> CalculatorEnv:
    """The real environment, its calculator where `where` says (`Workload.calculator`)."""
    env = CalculatorEnv(task)
    if where == "loop":
        ToolEnv.__init__(env, [calculator_in_loop])
    return env


class SimSampler:
    """A `Sampler` whose replies are real token ids and whose timing comes from a `SimCluster`.

    Turn t of an episode (t = assistant messages so far): filler tokens, then a calculator call on
    the question's expression, or, on the last turn, `<answer>{last tool result}</answer>`."""

    def __init__(self, cluster: SimCluster, renderer: Renderer, work: Workload, seed: int = 0,
                 server: ServerWork | None = None):
        self.cluster, self.renderer, self.work = cluster, renderer, work
        self.server = server if server is not None else ServerWork()
        self.rng = random.Random(seed)
        self.policy_version = 0
        self.filler = renderer.encode(FILLER * (work.max_tokens // 20 + 1))[: work.max_tokens]
        self.stop = renderer.stop_token_ids[0]
        self.responses = Responses(self.filler, token_pieces(renderer))  # the servers' response JSON, byte for
        # byte vLLM's (bench/sim_responses.py)
        self.tails: dict[tuple[bool, str], list[int]] = {}  # (call?, text) -> the ids ending a reply: the
        # server's work, made once per text so that the client's CPU per turn does not count it

    def reply_plan(self, messages: Sequence[Message]) -> tuple[int, list[int]]:
        """How many filler tokens the reply starts with, and the ids that end it (call or answer, stop)."""
        turn = sum(1 for m in messages if m.role == "assistant")
        n = self.rng.randint(self.work.min_tokens, self.work.max_tokens)
        call = turn < self.work.turns - 1
        return n, self.ending(call, next(m.content for m in messages if m.role == "user") if call
                            else messages[-1].content)

    def ending(self, call: bool, text: str) -> list[int]:
        """The ids ending a reply: a calculator call on the question `text`, or the answer `text` (the last tool
        result); encoded once per text."""
        key = (call, text)
        if key not in self.tails:
            expression = text.removeprefix("What is ").removesuffix("?")
            tail = ("\n" + self.renderer.format_reply("", (ToolCall("calculator", {"expression": expression}),))
                    if call else f"\n<answer>{text.strip()}</answer>")
            self.tails[key] = [*self.renderer.encode(tail), self.stop]
        return self.tails[key]

    def prepare(self, tasks: Sequence[dict[str, Any]]) -> None:
        """The endings of every task's replies, made before the episodes start: the servers' work, which would
        otherwise fall in the measured window whenever a task with a new question begins."""
        for task in tasks:
            self.ending(True, task["question"])
            self.ending(False, calculator(task["expression"]))

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
                     messages: Sequence[Message] = ()) -> Completion:
        server = self.server  # its work, timed apart: which reply, and the prefix cache's fingerprints
        n, tail = server.timed(self.reply_plan, messages)
        prompt = orjson.dumps(prompt_ids)
        request_body("sim", prompt, params)  # VLLMSampler's request body, written as it writes it
        conv = id(messages[0]) if messages else None  # the episode's first message object, one per episode
        await self.cluster.generate(conv, len(prompt_ids), n + len(tail),
                                    check=lambda k: server.timed(fingerprint, prompt_ids, k),
                                    tail=server.timed(reply_fingerprint, self.filler, n, tail))
        # the reply exists only once the server has answered, as with VLLMSampler's response
        raw = server.timed(self.responses.write, prompt, len(prompt_ids), n, tail)  # the server's work (the
        # ideal client's too): its echo is the request's JSON
        data = read_response(raw, "sim", prompt)  # read and checked as VLLMSampler does
        return response_completion(data, prompt_ids, self.policy_version, "sim")


def fingerprint(ids: Sequence[int], k: int) -> int:
    """What the simulated prefix cache compares of the context `ids[:k]`: its last 16 ids (the slice is the server's
    work too, timed with the hash)."""
    return hash(tuple(ids[k - 16:k]))


def reply_fingerprint(filler: Sequence[int], n: int, tail: Sequence[int]) -> int:
    """The fingerprint of a reply of `n` filler ids and then `tail`: its last 16 ids (`fingerprint`'s next time)."""
    return hash(tuple([*filler[max(0, n - 16):n], *tail][-16:]))


def workload_shape(renderer: Renderer) -> dict[str, int]:
    """Token counts of a calculator episode's pieces: the ideal client's prompt and reply lengths."""
    task = arithmetic_tasks(3)[2]
    env = CalculatorEnv(task)
    call = renderer.format_reply("", (ToolCall("calculator", {"expression": task["expression"]}),))
    system = [Message("system", SYSTEM)]
    return {"prompt": len(renderer.render([*system, Message("user", task["question"])], env.tool_schemas)),
            "system": len(renderer.render(system, env.tool_schemas, add_generation_prompt=False)),
            "call": len(renderer.encode("\n" + call)) + 1,
            "answer": len(renderer.encode(f"\n<answer>{task['answer']}</answer>")) + 1,
            "continuation": len(renderer.continuation([Message("tool", str(task["answer"]), name="calculator")]))}


async def runner_load(cluster: SimCluster, renderer: Renderer, work: Workload, concurrency: int,
                      episodes: int, started: list[int], server: ServerWork) -> None:
    """The real runner: `episodes` calculator episodes, `concurrency` at a time."""
    sampler = SimSampler(cluster, renderer, work, server=server)

    def make_env(task: dict[str, Any]) -> CalculatorEnv:
        started[0] += 1
        return calculator_env(task, work.calculator)

    limits = EpisodeLimits(max_turns=work.turns + 1, max_tokens_per_turn=1024, max_total_tokens=8192, seed=0)
    tasks = arithmetic_tasks(-(-episodes // work.group_size))
    sampler.prepare(tasks)
    groups = await rollout_groups(tasks, make_env, sampler, renderer, limits, work.group_size, concurrency)
    errors = [t.error for g in groups for t in g.trajectories if t.error]
    if errors:
        raise RuntimeError(f"{len(errors)} episodes failed, e.g. {errors[0]}")


async def ideal_load(cluster: SimCluster, work: Workload, concurrency: int, shape: dict[str, int],
                     started: list[int], text_ids: list[int], pieces: Sequence[str], server: ServerWork,
                     seed: int = 1) -> None:
    """A client with no cost at all: `concurrency` lanes, each playing episodes of the same lengths
    back to back (no tokenizer, no environment, no tool between the turns). Each turn the servers' response
    JSON is written, as the runner's side writes it, of ids of real text (`text_ids`: as many as a context has;
    `pieces`: each id's text, `token_pieces`)."""
    rng, responses = random.Random(seed), Responses(text_ids, pieces)

    async def lane() -> None:
        while True:
            started[0] += 1
            conv, prompt = object(), shape["prompt"]
            for turn in range(work.turns):
                out = server.timed(rng.randint, work.min_tokens, work.max_tokens)  # the servers' work, as the
                out += shape["call"] if turn < work.turns - 1 else shape["answer"]  # runner's side times it
                await cluster.generate(conv, prompt, out)
                server.timed(responses.write_prefix, prompt, out)  # the server's work, which the runner's side
                # pays too
                prompt += out + shape["continuation"]

    with ROLLOUT_GC.quiet():  # as the runner plays its episodes: the collections it does not make are not counted
        await asyncio.gather(*(lane() for _ in range(concurrency)))


def episodes_needed(servers: int, concurrency: int, gpu: GpuModel, work: Workload, seconds: float) -> int:
    """Enough episodes for the runner to stay at full concurrency for `seconds`: 1.5x the servers' rate,
    at most 2,000 a second (more than one event loop starts here; the bench says so if it runs dry)."""
    batch = max(1, min(gpu.max_seqs, concurrency // servers))
    tokens = (work.min_tokens + work.max_tokens) / 2 + 30
    turn_s = gpu.overhead_s + tokens * gpu.step_s(batch)
    rate = min(concurrency / turn_s, servers * batch / gpu.step_s(batch) / tokens) / work.turns
    return int(concurrency + min(1.5 * rate, 2000) * seconds)


async def measure_side(side: str, servers: int, concurrency: int, gpu: GpuModel, work: Workload,
                       renderer: Renderer, warmup: float, window: float, routing: str) -> dict[str, float]:
    """One side ("runner" or "ideal") at one scale: counters over `window` s after `warmup` s."""
    loop = asyncio.get_running_loop()
    shape = workload_shape(renderer)
    cluster, started, meter = SimCluster(servers, gpu, routing, shape["system"]), [0], LagMeter()
    episodes = episodes_needed(servers, concurrency, gpu, work, warmup + window)
    server = ServerWork()
    load = (runner_load(cluster, renderer, work, concurrency, episodes, started, server) if side == "runner"
            else ideal_load(cluster, work, concurrency, shape, started, renderer.encode(FILLER * 600),
                            token_pieces(renderer), server))
    tasks = [asyncio.create_task(load), asyncio.create_task(meter.run())]
    collections = CollectionTimes()
    gc.callbacks.append(collections)
    try:
        await asyncio.sleep(warmup)
        first, cpu0, wait0, t0, n_lags, faults0 = (cluster.snapshot(), time.process_time(), run_queue_s(),
                                                   loop.time(), len(meter.lags), page_faults())
        work0 = server.seconds
        await asyncio.sleep(window)
        last, cpu1, wait1, t1 = cluster.snapshot(), time.process_time(), run_queue_s(), loop.time()
        faults1, work1 = page_faults(), server.seconds
        lags = sorted(meter.lags[n_lags:])
        if tasks[0].done():
            tasks[0].result()  # raises what went wrong
        if side == "runner" and started[0] >= episodes:
            raise RuntimeError(f"all {episodes} episodes started before the window ended: the figures include the tail")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        cluster.close()
        gc.callbacks.remove(collections)
    seconds, cpu = t1 - t0, cpu1 - cpu0
    requests, tokens, prefill, prompt = (b - a for a, b in zip(first, last))
    return {"tok_s": tokens / seconds, "turns_s": requests / seconds, "cpu_util": cpu / seconds,
            "cpu_ms_per_turn": 1000 * cpu / max(requests, 1), "faults_per_turn": (faults1 - faults0) / max(requests, 1),
            "server_work_ms_per_turn": 1000 * (work1 - work0) / max(requests, 1),
            "max_lag_ms": 1000 * lags[-1] if lags else 0.0,
            "p99_lag_ms": 1000 * lags[int(0.99 * (len(lags) - 1))] if lags else 0.0,
            "prefix_hit": 1 - prefill / max(prompt, 1), "window_s": seconds, "cpu_wait": (wait1 - wait0) / seconds,
            "gc_in_window_ms": 1000 * collections.longest(t0, t1),
            "gc_after_ms": 1000 * collections.longest(t1, math.inf)}


async def measure_pair(servers: int, concurrency: int, gpu: GpuModel, work: Workload, renderer: Renderer,
                       warmup: float, window: float, routing: str = "sticky") -> dict[str, Any]:
    """The runner and the ideal client at the same scale, one after the other; the runner's share."""
    runner = await measure_side("runner", servers, concurrency, gpu, work, renderer, warmup, window, routing)
    gc.collect()
    ideal = await measure_side("ideal", servers, concurrency, gpu, work, renderer, warmup, window, routing)
    gc.collect()
    r = lambda x: round(x, 3)  # noqa: E731
    return {"servers": servers, "concurrency": concurrency, "share": r(runner["tok_s"] / ideal["tok_s"]),
            "max_lag_ms": r(runner["max_lag_ms"]), "p99_lag_ms": r(runner["p99_lag_ms"]),
            "runner_tok_s": round(runner["tok_s"]), "ideal_tok_s": round(ideal["tok_s"]),
            "share_of_peak": r(runner["tok_s"] / (servers * gpu.peak_tok_s)), "turns_s": round(runner["turns_s"], 1),
            "cpu_util": r(runner["cpu_util"]), "cpu_ms_per_turn": r(runner["cpu_ms_per_turn"]),
            "ideal_cpu_ms_per_turn": r(ideal["cpu_ms_per_turn"]), "ideal_max_lag_ms": r(ideal["max_lag_ms"]),
            "faults_per_turn": r(runner["faults_per_turn"]), "ideal_faults_per_turn": r(ideal["faults_per_turn"]),
            "server_work_ms_per_turn": r(runner["server_work_ms_per_turn"]),
            "ideal_server_work_ms_per_turn": r(ideal["server_work_ms_per_turn"]),
            # the runner's own: the ideal client pays the simulation's work (its servers, timers, routing) too; the
            # servers' work timed on each side (their JSON, their replies) is left out of both (module doc)
            "own_cpu_ms_per_turn": r(runner["cpu_ms_per_turn"] - runner["server_work_ms_per_turn"]
                                     - (ideal["cpu_ms_per_turn"] - ideal["server_work_ms_per_turn"])),
            "prefix_hit": r(runner["prefix_hit"]), "ideal_prefix_hit": r(ideal["prefix_hit"]),
            "cpu_wait": r(runner["cpu_wait"]), "window_s": r(runner["window_s"]),
            "gc_in_window_ms": r(runner["gc_in_window_ms"]), "gc_after_ms": r(runner["gc_after_ms"])}


INSTANT = GpuModel(step_base_s=1e-9, step_per_seq_s=0.0, prefill_tok_s=1e15, max_seqs=10**6, overhead_s=0.0)


async def measure_ceiling(work: Workload, renderer: Renderer, seconds: float = 8.0) -> dict[str, float]:
    """Both clients against servers that answer at once: the CPU cost of a turn, and the most turns a
    second one runner process (one event loop) can drive on this machine, whatever the GPUs."""
    runner = await measure_side("runner", 8, 512, INSTANT, work, renderer, seconds / 4, seconds, "sticky")
    gc.collect()
    ideal = await measure_side("ideal", 8, 512, INSTANT, work, renderer, seconds / 4, seconds, "sticky")
    gc.collect()
    return {"runner_turns_s": round(runner["turns_s"], 1),
            "runner_cpu_ms_per_turn": round(runner["cpu_ms_per_turn"], 3),
            "ideal_cpu_ms_per_turn": round(ideal["cpu_ms_per_turn"], 3), "cpu_wait": round(runner["cpu_wait"], 3)}


def each_scale(args: argparse.Namespace, measure: Callable[[int, int], Awaitable[dict[str, Any]]]) -> list[dict]:
    """`measure(servers, concurrency)` at every scale asked for, each row printed to stderr as it comes."""
    rows = []
    for servers in args.servers:
        for concurrency in args.concurrency:
            rows.append(asyncio.run(measure(servers, concurrency)))
            gc.collect()
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def runner_only(args: argparse.Namespace, gpu: GpuModel, work: Workload, renderer: Renderer) -> dict[str, Any]:
    """The runner's side alone at each scale (`--runner-only`): its CPU per turn and turns/s, in half the time."""
    async def side(servers: int, concurrency: int) -> dict[str, Any]:
        got = await measure_side("runner", servers, concurrency, gpu, work, renderer, args.warmup, args.window,
                                 args.routing)
        return {"servers": servers, "concurrency": concurrency, **{k: round(v, 3) for k, v in got.items()}}

    return {"bench": "runner_scale", "runner_only": True, "rows": each_scale(args, side)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[256, 1024, 4096, 8192])
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds before the window")
    ap.add_argument("--window", type=float, default=20.0, help="seconds measured, per side")
    ap.add_argument("--model", default="smollm2-135m", help="whose tokenizer renders the episodes")
    ap.add_argument("--routing", choices=["sticky", "least"], default="sticky")
    ap.add_argument("--calculator", choices=["worker", "loop"], default="worker",
                    help="where the runner's calculator runs: its worker process (as shipped) or in the event loop")
    ap.add_argument("--workers", type=int, nargs="+", help="the runner on this many Ray rollout workers each, against "
                                                          "one shared simulation (bench/runner_workers.py)")
    ap.add_argument("--runner-only", action="store_true",
                    help="only the runner's side at each scale (its CPU per turn, for comparing two trees): no ideal "
                         "client, no ceiling")
    for name, value in asdict(GpuModel()).items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = ap.parse_args()
    gpu = GpuModel(**{k: getattr(args, k) for k in asdict(GpuModel())})
    work = Workload(calculator=args.calculator)
    if args.workers:
        from bench.runner_workers import workers_bench

        print(json.dumps(workers_bench(args, gpu, work)))
        return
    renderer = load_renderer(resolve_model(args.model))
    if args.runner_only:
        print(json.dumps(runner_only(args, gpu, work, renderer)))
        return
    ceiling = asyncio.run(measure_ceiling(work, renderer))
    print(json.dumps({"ceiling": ceiling}), file=sys.stderr, flush=True)
    rows = each_scale(args, lambda servers, concurrency: measure_pair(
        servers, concurrency, gpu, work, renderer, args.warmup, args.window, args.routing))
    at_target = [row for row in rows if row["concurrency"] == 4096]
    print(json.dumps({
        "bench": "runner_scale", "gpu": asdict(gpu), "peak_tok_s_per_server": round(gpu.peak_tok_s),
        "workload": asdict(work), "routing": args.routing, "ceiling": ceiling, "rows": rows,
        "target": "share >= 0.95 and max_lag_ms < 50 at 4096 episodes",
        "target_met": bool(at_target) and all(x["share"] >= 0.95 and x["max_lag_ms"] < 50 for x in at_target),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }))


if __name__ == "__main__":
    main()
