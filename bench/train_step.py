"""Where a GRPO step's time goes: vLLM generation, forward/backward/optimizer, weight sync, the rest.

Runs `--steps` real steps of `agent_rl.trainer.train` (calculator env, 2 tasks x 4 rollouts,
64 tokens per turn, rank-16 LoRA of `--model`) in a temp run dir against one vLLM server (started
here, or `--server-url`), then pushes the trained adapter `--sync-reps` more times. The figures
come from the run's metrics.jsonl plus probes around the trainer's own stages, passed to it as
`trainer.Stages` (the loop runs unchanged); step 1 is warm-up and is skipped when there are >= 3
steps. Every rollout is trained on, with advantages +1/-1 where its group has no reward variance
(`forced_advantages`: the bare model
rarely earns a reward, and a step that drops every group would time no update at all);
`--real-advantages` turns that off.

How each term is measured, per step (then summed over the measured steps):
- step wall time: the trainer's `time/step_s` (sample to the end of the weight push; it leaves
  out metrics logging and checkpoint writes, so `run.save_every` = steps keeps those off the path).
- generation: wall time during which at least one `/v1/completions` request of the trainer is in
  flight (union of the intervals of `VLLMSampler.sample` calls), so concurrent episodes count once
  and env/tool/rendering time between turns does not count.
- forward/backward/optimizer: wall time of the trainer's `policy_update` call (micro-batch
  forwards, loss, backwards, grad clip, AdamW step); collating and the thread hop are not in it.
- sync: the trainer's `time/sync_s`, i.e. `AdapterSync.push` (save the adapter, load it on the
  server, unload the version before last).
- other = step - generation - forward/backward/optimizer - sync (env and tools, rendering, metrics,
  collating, the event loop). `overhead_ratio` = step / (generation + forward/backward/optimizer +
  sync); target <= 1.10.

`sync_seconds` (target <= 1.0) is the median over every push after the first (the first loads the
base-model adapter on a cold server) of the real rank-16 adapter to the real server: the in-run
pushes, then `--sync-reps` pushes of the trained adapter. Memory: `trainer_rss_peak_mib` is this
process's peak RSS (`getrusage`, the trainer runs in-process); `vllm_rss_peak_mib` is the highest
summed RSS of the server's process tree (api server, engine core, worker) seen by sampling /proc
every 0.2 s (pages shared between them count twice); null when attached by URL.

    python bench/train_step.py [--model smollm2-135m] [--steps 3] [--server-url URL]

Prints progress to stderr and one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_rl.core.config import load_config  # noqa: E402
from agent_rl.learn.advantages import group_advantages, grpo_advantages  # noqa: E402
from agent_rl.learn.models import resolve_model  # noqa: E402
from agent_rl.learn.update import policy_update  # noqa: E402
from agent_rl.rollout.merged import start_weight_sync  # noqa: E402
from agent_rl.rollout.server import VLLMServer, attach  # noqa: E402
from agent_rl.runs.runlog import read_metrics  # noqa: E402
from agent_rl.trainer import Stages, sample_step, train  # noqa: E402


class Probe:
    """Per-step generation busy time and policy_update time; the step advances when a push ends."""

    def __init__(self):
        self.step = 0  # 0 until the initial push (version 0) is done, then the step being run
        self.in_flight, self.busy_since = 0, 0.0
        self.gen_s: dict[int, float] = {}
        self.update_s: dict[int, float] = {}
        self.pushes: list[dict[str, float]] = []  # {"version", "total_s", "save_s", "load_s", "retire_s"}
        self.sync = self.model = None

    def request_started(self) -> None:
        if self.in_flight == 0:
            self.busy_since = time.perf_counter()
        self.in_flight += 1

    def request_ended(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.gen_s[self.step] = self.gen_s.get(self.step, 0.0) + time.perf_counter() - self.busy_since


class TimedSampler:
    """The trainer's sampler, with every request's time in flight recorded by the probe."""

    def __init__(self, sampler, probe: Probe):
        self._sampler, self._probe = sampler, probe

    @property
    def policy_version(self) -> int:
        return self._sampler.policy_version

    async def sample(self, prompt_ids, params, messages=()):
        self._probe.request_started()
        try:
            return await self._sampler.sample(prompt_ids, params, messages)
        finally:
            self._probe.request_ended()


class TimedSync:
    """The trainer's weight sync; each push is recorded and advances the probe's step."""

    def __init__(self, sync, probe: Probe):
        self.sync, self.probe = sync, probe

    async def push(self, model, version):
        self.probe.sync, self.probe.model = self.sync, model
        seconds = await self.sync.push(model, version)
        self.probe.pushes.append({"version": version, "total_s": seconds, **self.sync.last_timings})
        self.probe.step = version + 1
        return seconds

    def close(self):
        if hasattr(self.sync, "close"):
            self.sync.close()


def forced_advantages(groups, advantage_fn=grpo_advantages, truncated_reward=None):
    """Groups without signal still enter the batch, with advantages +1, -1, +1, ...

    The bare base model rarely earns a reward, so GRPO would drop every group and the step would
    train on nothing. The cost of the update depends on the tokens, not on the advantage values:
    this times a step in which every rollout is learned from. The logged group counts
    (`zero_variance_group_share`, `dropped_trajectories`) still describe the real rewards.
    """
    adv = group_advantages(groups, advantage_fn, truncated_reward)
    kept = {id(t) for t in adv.trajectories}
    extra = [t for g in groups if not any(id(t) in kept for t in g.trajectories)
             for t in g.trajectories if not t.infra_error]
    signs = [1.0 if i % 2 == 0 else -1.0 for i in range(len(extra))]
    return replace(adv, trajectories=adv.trajectories + tuple(extra), advantages=adv.advantages + tuple(signs))


def timed_stages(probe: Probe, force: bool) -> Stages:
    """The trainer's own stages, each wrapped in a probe: the loop runs unchanged."""

    async def sample(stream, cfg, session, sampler, limits, step):
        return await sample_step(stream, cfg, session, TimedSampler(sampler, probe), limits, step)

    def update(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return policy_update(*args, **kwargs)
        finally:
            probe.update_s[probe.step] = probe.update_s.get(probe.step, 0.0) + time.perf_counter() - t0

    async def sync(cfg, run_dir, sampler, model, version):
        t0 = time.perf_counter()
        inner = await start_weight_sync(cfg, run_dir, sampler, model, version)
        probe.pushes.append({"version": version, "total_s": time.perf_counter() - t0, **inner.last_timings})
        probe.sync, probe.model, probe.step = inner, model, version + 1
        return TimedSync(inner, probe)

    return Stages(sample=sample, advantages=forced_advantages if force else group_advantages,
                  update=update, sync=sync)


class TreeRSS(threading.Thread):
    """Samples the summed RSS of a process and its descendants until stopped; keeps the peak."""

    def __init__(self, pid: int, every_s: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.every_s = pid, every_s
        self.peak_kib, self.processes = 0, 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.every_s):
            pids = _descendants(self.pid)
            self.processes = max(self.processes, len(pids))
            self.peak_kib = max(self.peak_kib, sum(_status_kib(p, "VmRSS") for p in pids))

    def stop(self) -> None:
        self._done.set()
        self.join()


def _descendants(root: int) -> list[int]:
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = [root], [root]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier]
        out += frontier
    return out


def _status_kib(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--server-url", help="attach to a running vLLM server (started with --enable-lora)")
    ap.add_argument("--sync-reps", type=int, default=5, help="extra pushes of the trained adapter after the run")
    ap.add_argument("--real-advantages", action="store_true",
                    help="train only on groups with reward variance (default: every rollout, see forced_advantages)")
    ap.add_argument("--set", action="append", default=[], help="extra config override key=value")
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    run_dir = tempfile.mkdtemp(prefix="bench-train-step-")
    cfg = load_config(None, [
        f"model.name={args.model}", "model.lora_rank=16", f"run.steps={args.steps}", f"run.run_dir={run_dir}",
        f"run.save_every={args.steps}", "rollout.env=calculator", "rollout.tasks_per_step=2",
        "rollout.group_size=4", "rollout.max_tokens_per_turn=64", *args.set])
    if cfg.algorithm.overlap_rollouts:
        raise SystemExit("error: overlapped rollouts mix two steps' generation and training; "
                         "this split times them apart (drop algorithm.overlap_rollouts)")
    server = rss = None
    if args.server_url:
        url = attach(args.server_url)
    else:
        print(f"starting vLLM server on {model_dir}...", file=sys.stderr)
        s = cfg.sampler  # the server the trainer would start itself
        server = VLLMServer(model_dir, max_lora_rank=max(cfg.model.lora_rank, 8), kv_cache_gib=s.kv_cache_gib,
                            max_model_len=s.max_model_len, seed=cfg.run.seed,
                            log_path=Path(run_dir) / "vllm.log").start()
        url = server.url
        rss = TreeRSS(server.proc.pid)
        rss.start()
    probe = Probe()
    try:
        cfg = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"server_urls": [url]})})
        t0 = time.perf_counter()
        asyncio.run(train(cfg, stages=timed_stages(probe, force=not args.real_advantages)))
        run_wall = time.perf_counter() - t0

        async def more_pushes():
            for i in range(args.sync_reps):
                await probe.sync.push(probe.model, args.steps + 1 + i)

        asyncio.run(more_pushes())
    finally:
        try:
            if rss:
                rss.stop()
        finally:
            if server:
                server.stop()
    print(json.dumps(summary(args, cfg, run_dir, probe, rss, run_wall)))


def summary(args, cfg, run_dir: str, probe: Probe, rss: TreeRSS | None, run_wall: float) -> dict:
    """The figures of the run, from its metrics.jsonl and the probe."""
    records = read_metrics(run_dir)
    measured = [r for r in records if r["step"] > 1] if len(records) >= 3 else records
    step = [r["time/step_s"] for r in measured]
    gen = [probe.gen_s.get(r["step"], 0.0) for r in measured]
    fbo = [probe.update_s.get(r["step"], 0.0) for r in measured]
    sync = [r["time/sync_s"] for r in measured]
    other = [s - g - f - y for s, g, f, y in zip(step, gen, fbo, sync)]
    busy = sum(gen) + sum(fbo) + sum(sync)
    later = probe.pushes[1:]
    per_step = lambda xs: [round(x, 3) for x in xs]  # noqa: E731
    return {
        "bench": "train_step", "model": args.model, "steps": args.steps,
        "measured_steps": [r["step"] for r in measured],
        "rollouts_per_step": cfg.rollout.rollouts_per_step, "max_tokens_per_turn": cfg.rollout.max_tokens_per_turn,
        "forced_advantages": not args.real_advantages,
        "step_s": _median(step), "generation_s": _median(gen), "fwd_bwd_optim_s": _median(fbo),
        "sync_s": _median(sync), "other_s": _median(other),
        "rollout_s": _median([r["time/rollout_s"] for r in measured]),
        "train_s": _median([r["time/train_s"] for r in measured]),
        "overhead_ratio": round(sum(step) / busy, 3) if busy else None,
        "sync_seconds": _median([p["total_s"] for p in later]),
        "sync_save_s": _median([p["save_s"] for p in later]), "sync_load_s": _median([p["load_s"] for p in later]),
        "sync_retire_s": _median([p["retire_s"] for p in later]),
        "sync_first_s": round(probe.pushes[0]["total_s"], 3) if probe.pushes else None,
        "sync_pushes": len(later),
        "trainer_rss_peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "vllm_rss_peak_mib": round(rss.peak_kib / 1024, 1) if rss else None,
        "vllm_processes": rss.processes if rss else None,
        "tokens_per_s": _median([r["tokens_per_s"] for r in measured]),
        "reward_mean": _median([r.get("reward_mean", 0.0) for r in measured]),
        # the trainer logged update statistics as train/* before 097e798, plainly since
        "train_tokens": _median([r.get("train_tokens", 0.0) for r in measured]),
        "run_wall_s": round(run_wall, 1), "run_dir": run_dir,
        "per_step": {"step_s": per_step(step), "generation_s": per_step(gen), "fwd_bwd_optim_s": per_step(fbo),
                     "sync_s": per_step(sync), "other_s": per_step(other)},
    }


if __name__ == "__main__":
    main()
