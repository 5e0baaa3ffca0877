"""Where a GRPO step's time and memory go, and what merged-weight sync and gradient checkpointing change.

Owns: probes around the trainer's own stages (`Probe`, `TimedSampler`, `TimedSync`, `timed_stages`: passed as
`trainer.Stages`, the loop runs unchanged), the RSS samplers (`StageRSS`, `TreeRSS`), one variant's run in a child
process (`child`, so that each peak RSS is its own) and the JSON line (`summary`, `comparison`).
Does not own: the trainer, the server or the weight syncs (agent_rl's, as `agent-rl train` runs them).

`--steps` real steps of `agent_rl.trainer.train` on the recipe's configuration (examples/calculator_recipe.yaml,
from its SFT adapter when `--init-adapter` names it; `optim.micro_batch_tokens` 4096), once per variant, all
against one vLLM server started here in dev mode with LoRA (what a run starts):

    adapter-full     model.sync adapter, no gradient checkpointing, padded rows  (the trainer before these changes)
    adapter-ckpt     model.sync adapter, gradient checkpointing, padded rows
    merged-ckpt      model.sync merged, gradient checkpointing, shared prefixes packed (`optim.share_prefixes`;
                     what a run does here: model.sync auto picks merged)

Every rollout is trained on (`forced_advantages`, unless `--real-advantages`); step 1 is warm-up, left out when
there are >= 3 steps. Each figure and ratio of the JSON line, and what they measured:
docs/performance.md#the-bench-scripts.

    python bench/train_step.py [--steps 3] [--init-adapter runs/calculator_recipe/sft/adapter]
                               [--variants adapter-full adapter-ckpt merged-ckpt] [--model qwen2.5-coder-0.5b]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_rl.config.file import load_config
from agent_rl.learn.advantages import group_advantages, grpo_advantages
from agent_rl.learn.models import resolve_model
from agent_rl.learn.update import policy_update
from agent_rl.rollout.players import LocalPlayers
from agent_rl.rollout.serving.vllm.server import VLLMServer, attach
from agent_rl.rollout.weight_sync.choose import start_weight_sync
from agent_rl.runs.runlog import read_metrics
from agent_rl.trainer import Stages, open_stream, train


class Probe:
    """Per-step generation busy time and policy_update time; the step advances when a push ends."""

    def __init__(self):
        self.step = 0  # 0 until the initial push (version 0) is done, then the step being run
        self.in_flight, self.busy_since = 0, 0.0
        self.gen_s: dict[int, float] = {}
        self.update_s: dict[int, float] = {}
        self.pushes: list[dict[str, float]] = []  # {"version", "total_s", "save_s", "load_s", "retire_s"}
        self.sync = self.model = None
        self.stage = "start"  # what the trainer is doing: start, sample, update, sync (StageRSS's labels)

    def request_started(self) -> None:
        if self.in_flight == 0:
            self.busy_since = time.perf_counter()
            if self.stage != "update":  # the step's sampling begins (the synchronous loop: after the push)
                self.stage = "sample"
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

    def __getattr__(self, name):  # restore, finish: the inner sync's
        return getattr(self.sync, name)


def forced_advantages(groups, advantage_fn=grpo_advantages, credit=None):
    """Groups without signal still enter the batch, with advantages +1, -1, +1, ... (each turn its
    trajectory's, with credit per turn).

    The bare base model rarely earns a reward, so GRPO would drop every group and the step would
    train on nothing. The cost of the update depends on the tokens, not on the advantage values:
    this times a step in which every rollout is learned from. The logged group counts
    (`zero_variance_group_share`, `dropped_trajectories`) still describe the real rewards.
    """
    adv = group_advantages(groups, advantage_fn, credit)
    kept = {id(t) for t in adv.trajectories}
    extra = [t for g in groups if not any(id(t) in kept for t in g.trajectories)
             for t in g.trajectories if not t.infra_error]
    signs = [1.0 if i % 2 == 0 else -1.0 for i in range(len(extra))]
    per_turn = None if adv.turn_advantages is None else \
        adv.turn_advantages + tuple((s,) * len(t.turns) for t, s in zip(extra, signs))
    return replace(adv, trajectories=adv.trajectories + tuple(extra), advantages=adv.advantages + tuple(signs),
                   turn_advantages=per_turn)


def timed_stages(probe: Probe, force: bool) -> Stages:
    """The trainer's own stages, each wrapped in a probe: the loop runs unchanged."""

    def stream(run, players):  # the episodes played here, through the probe's sampler
        sampler = TimedSampler(players.meter.inner, probe)
        return open_stream(run, LocalPlayers(run.session.env.make_env, sampler, run.session.renderer,
                                             players.meter.servers))

    def update(*args, **kwargs):
        probe.stage = "update"
        t0 = time.perf_counter()
        try:
            return policy_update(*args, **kwargs)
        finally:
            probe.update_s[probe.step] = probe.update_s.get(probe.step, 0.0) + time.perf_counter() - t0
            probe.stage = "sync"  # then the push (and the loop's bookkeeping) until the next sampling

    async def sync(model_cfg, rollout, max_staleness, run_dir, sampler, model, version):
        probe.stage = "sync"
        t0 = time.perf_counter()
        inner = await start_weight_sync(model_cfg, rollout, max_staleness, run_dir, sampler, model, version)
        probe.pushes.append({"version": version, "total_s": time.perf_counter() - t0, **inner.last_timings})
        probe.sync, probe.model, probe.step = inner, model, version + 1
        return TimedSync(inner, probe)

    return Stages(stream=stream, advantages=forced_advantages if force else group_advantages,
                  update=update, sync=sync)


class PeakRSS(threading.Thread):
    """The summed RSS of process `pid` (with `tree`, and of its descendants) every `every_s` until stopped: the
    highest seen under each label `label()` gives, and the most processes seen."""

    def __init__(self, pid: int, every_s: float, label: Callable[[], str] = lambda: "all", tree: bool = False):
        super().__init__(daemon=True)
        self.pid, self.every_s, self.label, self.tree = pid, every_s, label, tree
        self.peak_kib: dict[str, int] = {}
        self.processes = 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.every_s):
            pids = _descendants(self.pid) if self.tree else [self.pid]
            self.processes, label = max(self.processes, len(pids)), self.label()
            self.peak_kib[label] = max(self.peak_kib.get(label, 0), sum(_status_kib(p, "VmRSS") for p in pids))

    def stop(self) -> dict[str, float]:
        self._done.set()
        self.join()
        return {k: round(v / 1024, 1) for k, v in self.peak_kib.items()}


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


VARIANTS = {
    "adapter-full": ["model.sync=adapter", "model.gradient_checkpointing=false", "optim.share_prefixes=false"],
    "adapter-ckpt": ["model.sync=adapter", "model.gradient_checkpointing=true", "optim.share_prefixes=false"],
    "merged-ckpt": ["model.sync=merged", "model.gradient_checkpointing=true", "optim.share_prefixes=true"],
}


def child(args) -> None:
    """One variant's run in this process: its JSON line on stdout."""
    run_dir = tempfile.mkdtemp(prefix=f"bench-train-step-{args.child}-")
    recipe = str(Path(__file__).resolve().parents[1] / "examples" / "calculator_recipe.yaml")
    cfg = load_config(recipe, [
        *([f"model.name={args.model}"] if args.model else []), f"run.steps={args.steps}", f"run.run_dir={run_dir}",
        f"run.save_every={args.steps}", "run.tensorboard=false",
        f"sampler.server_urls=[{args.server_url}]", "optim.micro_batch_tokens=4096",
        *([f"model.init_adapter={args.init_adapter}"] if args.init_adapter else []), *VARIANTS[args.child],
        *args.set])
    probe = Probe()
    stage_rss = PeakRSS(os.getpid(), 0.02, lambda: probe.stage)
    stage_rss.start()
    t0 = time.perf_counter()
    asyncio.run(train(cfg, stages=timed_stages(probe, force=not args.real_advantages)))
    by_stage = stage_rss.stop()
    print(json.dumps({"variant": args.child, **summary(args, cfg, run_dir, probe, time.perf_counter() - t0),
                      "trainer_rss_peak_by_stage_mib": by_stage}))


def run_variants(args, url: str) -> list[dict]:
    out = []
    for variant in args.variants:
        print(f"variant {variant}...", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--child", variant, "--server-url", url, "--steps", str(args.steps),
               *(["--model", args.model] if args.model else []),
               *(["--init-adapter", args.init_adapter] if args.init_adapter else []),
               *(["--real-advantages"] if args.real_advantages else []), *[f"--set={x}" for x in args.set]]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"error: variant {variant} failed: {proc.stderr.strip().splitlines()[-1:]}")
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--init-adapter", help="the recipe's SFT adapter (runs/calculator_recipe/sft/adapter), "
                                           "so that rollouts call the tool as the recipe's GRPO steps do")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--server-url", help="attach to a running vLLM server (dev mode, LoRA)")
    ap.add_argument("--real-advantages", action="store_true",
                    help="train only on groups with reward variance (default: every rollout, see forced_advantages)")
    ap.add_argument("--model", help="the policy (default: the recipe's, smollm2-135m), e.g. qwen2.5-coder-0.5b")
    ap.add_argument("--set", action="append", default=[], help="extra config override key=value")
    ap.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    server = rss = None
    if args.server_url:
        url = attach(args.server_url)
    else:
        print("starting a vLLM server (dev mode, LoRA)...", file=sys.stderr)
        recipe = load_config(str(Path(__file__).resolve().parents[1] / "examples" / "calculator_recipe.yaml"))
        server = VLLMServer(resolve_model(args.model or recipe.model.name), max_lora_rank=16, startup_timeout_s=900,
                            kv_cache_gib=recipe.sampler.kv_cache_gib,
                            max_model_len=recipe.sampler.max_model_len, dev_mode=True).start()
        url = server.url
        rss = PeakRSS(server.proc.pid, 0.2, tree=True)
        rss.start()
    try:
        results = {r["variant"]: r for r in run_variants(args, url)}
    finally:
        if rss:
            rss.stop()
        if server:
            server.stop()
    print(json.dumps(comparison(results, rss)))


def comparison(results: dict[str, dict], rss) -> dict:
    def ratio(a: str, b: str, key: str):
        if a in results and b in results and results[b][key]:
            return round(results[a][key] / results[b][key], 3)
        return None

    return {
        "bench": "train_step", "variants": list(results), "model": next(iter(results.values()), {}).get("model"),
        "ckpt_step_time_ratio": ratio("adapter-ckpt", "adapter-full", "fwd_bwd_optim_s"),
        "ckpt_rss_ratio": ratio("adapter-ckpt", "adapter-full", "trainer_rss_peak_mib"),
        "ckpt_rss_mib": results.get("adapter-ckpt", {}).get("trainer_rss_peak_mib"),
        "merged_tok_per_step_s_ratio": ratio("merged-ckpt", "adapter-ckpt", "sampled_tok_per_step_s"),
        "step_time_vs_before": ratio("merged-ckpt", "adapter-full", "step_s"),
        "vllm_rss_peak_mib": rss.stop().get("all") if rss else None,
        **{name: {k: v for k, v in r.items() if k not in ("bench", "variant", "run_dir")}
           for name, r in results.items()},
    }


def summary(args, cfg, run_dir: str, probe: Probe, run_wall: float) -> dict:
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
    sampled = [r["tokens_per_s"] for r in measured]  # the trainer's own: sampled tokens / step wall time
    gen_rate = [r["tokens_per_s"] * r["time/step_s"] / g for r, g in zip(measured, gen) if g]
    train_rate = [r.get("train_tokens", 0.0) / f for r, f in zip(measured, fbo) if f]
    return {
        "bench": "train_step", "model": cfg.model.name, "steps": args.steps, "sync": cfg.model.sync,
        "gradient_checkpointing": cfg.model.gradient_checkpointing, "sampled_tok_per_step_s": _median(sampled),
        "measured_steps": [r["step"] for r in measured],
        "rollouts_per_step": cfg.rollout.rollouts_per_step, "max_tokens_per_turn": cfg.rollout.max_tokens_per_turn,
        "forced_advantages": not args.real_advantages,
        "step_s": _median(step), "generation_s": _median(gen), "fwd_bwd_optim_s": _median(fbo),
        "sync_s": _median(sync), "other_s": _median(other),
        "rollout_s": _median([r["time/wait_s"] for r in measured]),
        "train_s": _median([r["time/train_s"] for r in measured]),
        "overhead_ratio": round(sum(step) / busy, 3) if busy else None,
        "sync_seconds": _median([p["total_s"] for p in later]),
        **{f"sync_{k}": _median([p[k] for p in later if k in p])
           for k in ("save_s", "load_s", "retire_s", "drain_s", "reload_s", "resume_s") if any(k in p for p in later)},
        "sync_first_s": round(probe.pushes[0]["total_s"], 3) if probe.pushes else None,
        "sync_pushes": len(later),
        "trainer_rss_peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "vllm_rss_peak_mib": None, "vllm_processes": None,  # the server's, in comparison(): it serves every variant
        "tokens_per_s": _median([r["tokens_per_s"] for r in measured]),
        "sampled_tok_per_gen_s": _median(gen_rate), "trainer_tok_per_s": _median(train_rate),
        "reward_mean": _median([r.get("reward_mean", 0.0) for r in measured]),
        # the trainer logged update statistics as train/* before 097e798, plainly since
        "train_tokens": _median([r.get("train_tokens", 0.0) for r in measured]),
        "computed_token_share": _median([r["computed_token_share"] for r in measured if "computed_token_share" in r]),
        "run_wall_s": round(run_wall, 1), "run_dir": run_dir,
        "per_step": {"step_s": per_step(step), "generation_s": per_step(gen), "fwd_bwd_optim_s": per_step(fbo),
                     "sync_s": per_step(sync), "other_s": per_step(other)},
    }


if __name__ == "__main__":
    main()
