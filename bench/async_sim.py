"""Asynchronous training at scale, simulated: the real training loop against simulated GPU servers and a
simulated trainer, with long-tailed agent episodes, for `algorithm.max_staleness` k = 0, 1, 2, 4.

Owns: the long-tailed workload (`Tail`, `TailSampler`), the simulated trainer and weight push (`SimTrainer`,
`SimPush`), one run (`measure`) and the table of them (`main`).
Does not own: the servers' latency model and the simulated clock (bench/shared/), nor anything that is measured:
the loop, the rollout stream, admission, the runner, the calculator environment and its tool, the renderer are
agent-rl's own (`trainer.loop`, `trainer.open_stream`).

The trainer's time is spent inside the push (the only awaitable stage after the update), the stream playing on
meanwhile. With in-flight pushes the episodes play on through a push and their later turns sample with the new
version; without, a push first stops new episodes from starting, waits for every episode in flight to end, pushes,
then lets them start again. What is simulated, the workload's numbers and what it has measured:
docs/performance.md#asynchronous-training-simulated.

    python bench/async_sim.py [--servers 8 64] [--staleness 0 1 2 4] [--sample-ahead 1 ...] [--pushes in-flight]
        [--steps 20]
(progress on stderr, one JSON line on stdout)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from agent_rl import trainer
from agent_rl.config.file import load_config
from agent_rl.core.renderers.choose import load_renderer
from agent_rl.core.types import Message
from agent_rl.envs.base import ToolEnv, turn_rewards_on
from agent_rl.envs.calculator import CalculatorEnv, arithmetic_tasks
from agent_rl.learn.advantages import GroupAdvantages
from agent_rl.learn.models import resolve_model
from agent_rl.learn.policy import Policy
from agent_rl.rollout.players import LocalPlayers
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.runs.runlog import RunLogger
from agent_rl.session import Session, env_of
from agent_rl.tools import calculator as calculator_tool
from bench.shared import sim_clock
from bench.shared.sim_episodes import FILLER, SimSampler, Workload
from bench.shared.sim_servers import GpuModel, SimCluster


@dataclass(frozen=True)
class Tail:
    """The long-tailed agent workload (module doc)."""

    group_size: int = 4
    tasks_per_server: int = 2
    min_turns: int = 2
    max_turns: int = 6
    median_tokens: int = 100
    sigma: float = 0.6
    clip: tuple[int, int] = (16, 400)
    tool_median_s: float = 0.0
    tool_sigma: float = 0.8
    long_share: float = 0.02
    long_factor: int = 10

    def draw(self, rng: random.Random, median: float, sigma: float) -> float:
        return rng.lognormvariate(math.log(median), sigma) if median > 0 else 0.0


class TailSampler(SimSampler):
    """`SimSampler` with each episode's length drawn from `Tail`: its turns, and whether it is a long one."""

    def __init__(self, cluster: SimCluster, renderer: Any, tail: Tail, seed: int = 0):
        most = tail.clip[1] * tail.long_factor
        super().__init__(cluster, renderer, Workload(turns=tail.max_turns, max_tokens=most), seed)
        self.filler = renderer.encode(FILLER * (most // 20 + 1))[:most]
        self.tail, self.plans = tail, {}

    @property
    def urls(self) -> list[str]:
        """One per simulated server: the stream counts them for its idle-share estimate."""
        return [f"sim://{i}" for i in range(len(self.cluster.servers))]

    def tool_s(self, messages: Any) -> float:
        """How long the tool call that follows this conversation's last reply takes (long episodes 10x)."""
        plan = self.plans.get(id(messages[0]))
        factor = plan[2] if plan else 1
        return factor * self.tail.draw(self.rng, self.tail.tool_median_s, self.tail.tool_sigma)

    def reply_plan(self, messages: Any) -> tuple[int, list[int]]:
        tail, rng = self.tail, self.rng
        first = messages[0]  # one object per episode
        if id(first) not in self.plans:
            self.plans[id(first)] = (first, rng.randint(tail.min_turns, tail.max_turns),
                                     tail.long_factor if rng.random() < tail.long_share else 1)
        _, turns, factor = self.plans[id(first)]
        n = min(max(round(tail.draw(rng, tail.median_tokens, tail.sigma)), tail.clip[0]), tail.clip[1])
        self.work = replace(self.work, turns=turns)
        done = sum(1 for m in messages if m.role == "assistant")
        _, ids = super().reply_plan(messages)
        if done >= turns - 1:
            self.plans.pop(id(first), None)
        return n * factor, ids


async def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    Args:
        expression: The expression, e.g. "(12 + 7) * 3".
    """
    return calculator_tool.calculator(expression)  # the real tool, run in the loop: no process to wait for


class SimCalculatorEnv(CalculatorEnv):
    """The calculator environment with its tool called in the event loop (bench/sim_clock.py waits for no
    worker process)."""

    def __init__(self, task: dict[str, Any]):
        ToolEnv.__init__(self, [calculator])
        self.task = task
        self.turn_rewards = turn_rewards_on(task)  # CalculatorEnv's switch (off: the task has no such column)


class SimTrainer:
    """The update (in a thread, taking no simulated time) notes the batch's tokens; `train_s` is their cost."""

    def __init__(self, tok_s: float):
        self.tok_s, self.tokens = tok_s, 0

    def update(self, policy: Policy, batch: Any, *args: Any) -> dict[str, float]:
        self.tokens = int(batch.attention_mask_B_T.sum())
        policy.optimizer.step()  # no gradients: nothing moves; the loop steps the schedule after it
        return {"loss": 0.0}


class SimPush:
    """Training time, then the push; with `drain`, no push while an episode is in flight (module doc)."""

    def __init__(self, sampler: TailSampler, trainer_: SimTrainer, push_s: float, drain: bool):
        self.sampler, self.trainer, self.push_s, self.drain = sampler, trainer_, push_s, drain
        self.gate, self.playing, self.in_flight = asyncio.Event(), 0, []
        self.gate.set()

    async def push(self, model: Any, version: int) -> float:
        await asyncio.sleep(self.trainer.tokens / self.trainer.tok_s)
        self.in_flight.append(self.playing)
        if self.drain:
            self.gate.clear()
            while self.playing:
                await asyncio.sleep(0.05)
        await asyncio.sleep(self.push_s)
        self.sampler.policy_version = version
        self.gate.set()
        return self.push_s

    async def finish(self) -> None:
        pass

    def env(self, task: dict[str, Any]) -> SimCalculatorEnv:
        push = self

        class Gated(SimCalculatorEnv):
            counted, first = False, None

            async def initial_messages(self) -> list[Message]:
                await push.gate.wait()
                push.playing, self.counted = push.playing + 1, True
                messages = await super().initial_messages()
                self.first = messages[0]  # the runner's conversation starts with this very object
                return messages

            async def step(self, reply: Message, turn: int) -> Any:
                if reply.tool_calls:  # the tool's own time (the calculator itself answers at once)
                    await asyncio.sleep(push.sampler.tool_s([self.first]))
                return await super().step(reply, turn)

            async def close(self) -> None:
                push.playing -= self.counted
                await super().close()

        return Gated(task)


def all_trained(groups: Any, advantage_fn: Any, credit: Any = None) -> GroupAdvantages:
    """Every episode enters the batch (advantages +1, -1, ...): the scripted replies are all right, so GRPO
    would drop every group, and the trainer's cost is its tokens'."""
    trajs = tuple(t for g in groups for t in g.trajectories if not t.infra_error)
    if len(trajs) < sum(len(g.trajectories) for g in groups):
        errors = [t.error for g in groups for t in g.trajectories if t.infra_error]
        print(f"{len(errors)} episodes failed, e.g. {errors[0]}", file=sys.stderr, flush=True)
    return GroupAdvantages(trajs, tuple(1.0 - 2 * (i % 2) for i in range(len(trajs))), len(groups), 0, 0, 0)


def setup(servers: int, staleness: int, steps: int, tail: Tail, run_dir: Path, renderer: Any, smol: Path,
          ahead: float | None = None):
    tasks = servers * tail.tasks_per_server
    cfg = load_config(None, [*([] if ahead is None else [f"algorithm.sample_ahead={ahead}"]),
        "rollout.env=calculator", f"rollout.tasks_per_step={tasks}", f"rollout.group_size={tail.group_size}",
        f"rollout.max_concurrent={(staleness + 1) * tasks * tail.group_size}",
        f"rollout.max_turns={tail.max_turns + 1}",
        "rollout.max_tokens_per_turn=8192", "rollout.max_total_tokens=65536", "sampler.max_model_len=65536",
        f"algorithm.max_staleness={staleness}", "algorithm.tis_cap=null", f"run.steps={steps}",
        f"run.run_dir={run_dir}", f"run.save_every={10 * steps}", "run.tensorboard=false", "run.trace_groups=0"])
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = Policy(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))
    limits = replace(EpisodeLimits.from_config(cfg.rollout), env_timeout_s=3600.0)  # a drain may take minutes
    run = trainer.Run(cfg, run_dir, Session(cfg, smol, renderer, env_of(cfg)), policy,
                      trainer.TaskStream(arithmetic_tasks(tasks * steps)), limits)
    return cfg, run


async def measure(servers: int, staleness: int, drain: bool, args: Any, renderer: Any, smol: Path,
                  ahead: float | None = None) -> dict[str, Any]:
    """One simulated run (`ahead`: `algorithm.sample_ahead`, None: its default): its figures over steps
    [warm, steps - warm)."""
    tail, gpu = args.tail, args.gpu
    with tempfile.TemporaryDirectory(prefix="async-sim-") as tmp:
        cfg, run = setup(servers, staleness, args.steps, tail, Path(tmp), renderer, smol, ahead)
        cluster = SimCluster(servers, gpu, "least", seed=args.seed)  # VLLMSampler's routing
        sampler = TailSampler(cluster, renderer, tail, seed=args.seed)
        sim = SimTrainer(args.train_tok_s * servers * args.trainer_gpus_per_server)
        push = SimPush(sampler, sim, args.push_s, drain)
        run.session = replace(run.session, env=replace(run.session.env, make_env=push.env))
        loop = asyncio.get_running_loop()
        marks: list[tuple[float, float, float]] = []  # (time, busy server-seconds, sampled tokens) at each batch

        def advantages(groups: Any, advantage_fn: Any, credit: Any) -> GroupAdvantages:
            adv = all_trained(groups, advantage_fn)  # one advantage per episode, whatever the credit
            marks.append((loop.time(), cluster.busy_s(), float(sum(t.num_sampled for t in adv.trajectories))))
            return adv

        stages = trainer.Stages(advantages=advantages, update=sim.update)
        with RunLogger(run.run_dir, cfg.run.steps, tensorboard=False, progress=False) as log:
            players = LocalPlayers(run.session.env.make_env, sampler, renderer, servers=len(sampler.urls))
            await trainer.loop(run, players, push, log, stages)
        lines = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
        cluster.close()
    a, b, tasks = args.warm, args.steps - args.warm, cfg.rollout.tasks_per_step
    seconds = marks[b][0] - marks[a][0]
    window = lines[a + 1: b + 1]  # the steps whose batches arrived inside the window
    return {"servers": servers, "staleness": staleness, "sample_ahead": cfg.algorithm.slots_ahead(tasks) / tasks,
            "in_flight_pushes": not drain,
            "trained_tok_s": round(sum(m[2] for m in marks[a + 1: b + 1]) / seconds),
            "step_s": round(seconds / (b - a), 2),
            "lag_mean": round(sum(x["lag/mean"] for x in window) / len(window), 3),
            "lag_max": max(x["lag/max"] for x in window),
            "idle_share": round(1 - (marks[b][1] - marks[a][1]) / (servers * seconds), 3),
            "idle_share_stream": round(sum(x["server_idle_share"] for x in window) / len(window), 3),
            "wait_s": round(sum(x["time/wait_s"] for x in window) / len(window), 2),
            "episodes_in_flight_at_push": round(sum(push.in_flight[a + 1: b + 1]) / (b - a), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    ap.add_argument("--sample-ahead", type=float, nargs="*", default=[],
                    help="algorithm.sample_ahead values to run at each k (each capped at k); none: its default")
    ap.add_argument("--pushes", choices=["both", "in-flight"], default="both",
                    help="also run each k > 0 with pushes that drain the episodes in flight (both), or not")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warm", type=int, default=6, help="steps left out at each end (filling, draining)")
    ap.add_argument("--train-tok-s", type=float, default=8200.0, help="trainer tokens/s per trainer GPU")
    ap.add_argument("--trainer-gpus-per-server", type=float, default=0.5)
    ap.add_argument("--push-s", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    for group, cls in (("tail", Tail), ("gpu", GpuModel)):  # every number of the workload and the servers
        for name, value in asdict(cls()).items():
            kind = {"type": type(value[0]), "nargs": len(value)} if isinstance(value, tuple) else {"type": type(value)}
            ap.add_argument(f"--{group}-{name.replace('_', '-')}", default=value, **kind)
    args = ap.parse_args()
    args.tail = Tail(**{k: tuple(v) if isinstance(v, list) else v for k in asdict(Tail())
                        for v in [getattr(args, f"tail_{k}")]})
    args.gpu = GpuModel(**{k: getattr(args, f"gpu_{k}") for k in asdict(GpuModel())})
    smol = resolve_model("smollm2-135m")
    renderer = load_renderer(smol)
    rows, t0 = [], time.perf_counter()
    for servers in args.servers:
        for k in args.staleness:
            for ahead in sorted({min(a, k) for a in args.sample_ahead}) or [None]:
                for drain in ([False] if k == 0 or args.pushes == "in-flight" else [False, True]):  # k = 0: nothing
                    random.seed(args.seed)  # plays during a push
                    row = sim_clock.run(measure(servers, k, drain, args, renderer, smol, ahead))
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    rows.append(row)
    for row in rows:
        base = next(r for r in rows if r["servers"] == row["servers"] and r["staleness"] == 0)  # (any ahead: 0)
        row["speedup"] = round(row["trained_tok_s"] / base["trained_tok_s"], 3)
    at_target = [r for r in rows if r["servers"] == 64 and r["staleness"] == 2 and r["in_flight_pushes"]]
    print(json.dumps({
        "bench": "async_sim", "workload": asdict(args.tail), "gpu": asdict(args.gpu),
        "trainer": {"tok_s_per_gpu": args.train_tok_s, "gpus_per_server": args.trainer_gpus_per_server,
                    "push_s": args.push_s},
        "steps": args.steps, "window": [args.warm, args.steps - args.warm], "rows": rows,
        "target": "k = 2 with in-flight pushes >= 1.6x k = 0 at 64 servers, mean lag <= 1",
        "target_met": any(r["speedup"] >= 1.6 and r["lag_mean"] <= 1 for r in at_target),  # at some sample_ahead
        "cpu_s": round(time.process_time(), 1), "wall_s": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
