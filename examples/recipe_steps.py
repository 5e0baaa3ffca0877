"""What the multi-seed recipes in examples/ share: steps as `agent-rl` processes, their server, their figures.

Owns: `step` (one `agent-rl` command in its own process, skipped when its output exists), `attempts`
(a recipe retried after a failed step, resuming where it stopped), `recipe_server` (the one vLLM
server a recipe's sampling steps share) and `restore_base` (its weights back to the base model's),
`seed_summary` (after - before per seed, the smallest gain and the spread over seeds), `per_step` and
`alarm_steps` (a run's training curves as lists, read from its metrics.jsonl), `plot_panels` (a PNG
with a panel per metric and a line per run, which names the script that drew it).
Does not own: what a recipe runs or reports (`gui_recipe.py`, `collapse_study.py`), the commands
themselves (`agent_rl.cli`), metrics files (`agent_rl.runs.runlog`).

Used by `examples/gui_recipe.py` and `examples/collapse_study.py`, which import it from their own folder.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agent_rl.cli import raise_on_sigterm
from agent_rl.runs.runlog import read_metrics


class StepFailed(RuntimeError):
    """An `agent-rl` step exited with an error (or was killed, e.g. by the kernel's OOM killer)."""


def attempts(pipeline: Callable[[], Any], tries: int = 3) -> Any:
    """Run `pipeline` until it gets through without a failed step, at most `tries` times. Each try
    skips the steps already done and resumes a killed SFT or GRPO run from its last checkpoint
    (`--resume`), and starts its own server: on a shared machine the OOM killer may take any process."""
    for i in range(1, tries + 1):
        try:
            return pipeline()
        except StepFailed as e:
            print(f"\n{e} (try {i} of {tries})", file=sys.stderr, flush=True)
    sys.exit(f"recipe stopped: a step failed {tries} times")


def step(done: Path, *argv: str, server: Any = None) -> float | None:
    """`agent-rl ARGV` in its own process, unless `done` exists; raises StepFailed on failure.
    Returns its wall time in seconds (None: skipped). Its own process: a trainer's memory (several GB)
    is back before the next step starts. `server`: a step that samples on it gets the base weights
    back first (`restore_base`)."""
    if done.exists():
        print(f"\n(skipped: {done} exists) agent-rl {argv[0]}", file=sys.stderr, flush=True)
        return None
    t0 = time.perf_counter()
    if server is not None:
        restore_base(server)
    print("\n$ agent-rl " + " ".join(argv), file=sys.stderr, flush=True)
    code = subprocess.run([sys.executable, "-m", "agent_rl.cli", *argv]).returncode
    if code:
        raise StepFailed(f"`agent-rl {' '.join(argv)}` exited with {code}")
    return time.perf_counter() - t0


def recipe_args(description: str, run_dir: str, seeds_help: str, arms: Sequence[str] = (),
                default_arms: Sequence[str] = ()) -> argparse.Namespace:
    """The command line every recipe takes: where it writes, its GRPO seeds, overrides for every step; with `arms`,
    which of them to run (`--arm`, repeated; `default_arms`, else the first, without one). A SIGTERM then unwinds
    the recipe like Ctrl-C (`agent_rl.cli.raise_on_sigterm`): its server stops."""
    raise_on_sigterm()
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--run-dir", default=run_dir)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help=seeds_help)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every step")
    if arms:
        default = list(default_arms) or [arms[0]]
        p.add_argument("--arm", action="append", choices=arms, help=f"an arm to run (default: {' '.join(default)})")
    args = p.parse_args()
    if arms and not args.arm:
        args.arm = default
    return args


def cold_start(config: str, out: Path, sets: Sequence[str], wall: dict) -> list[str]:
    """Steps 1-2, demonstrations then SFT (each skipped when done); returns the arguments every later
    step shares (the config, its demos and the `--set` overrides)."""
    common = [config, "--set", f"sft.demos={out}/demos.jsonl", *[x for s in sets for x in ("--set", s)]]
    note(wall, "demos", step(out / "demos.jsonl", "demos", *common))
    note(wall, "sft", step(out / "sft" / "adapter", "sft", *common, "--set", f"sft.run_dir={out}/sft", "--resume"))
    return common


def grpo(common: Sequence[str], out: Path, run_dir: Path, seed: int, server: Any, *extra: str) -> float | None:
    """Step 3 for one seed: GRPO from the SFT adapter into `run_dir`, resumed if a checkpoint is there."""
    return step(run_dir / "adapter", "train", *common, *extra, "--resume",
                "--set", f"model.init_adapter={out}/sft/adapter", "--set", f"run.run_dir={run_dir}",
                "--set", f"run.seed={seed}", server=server)


def evaluate_runs(path: Path, common: Sequence[str], out: Path, run_dirs: Sequence[str], server: Any,
                  *extra: str) -> float | None:
    """Step 4: the SFT adapter and every run's on the same held-out tasks, always afresh, into `path`."""
    path.unlink(missing_ok=True)  # always evaluate what is there now
    adapters = [x for a in [str(out / "sft"), *run_dirs] for x in ("--adapter", a)]
    return step(path, "eval", *common, *extra, *adapters, "--out", str(path), server=server)


def recipe_server(out: Path, max_model_len: int, kv_cache_gib: int = 1, model: str = "smollm2-135m",
                  dtype: str = "auto"):
    """One vLLM server of `model` (SmolLM2-135M unless named) for every step of a recipe: LoRA adapters are
    hot-loaded under unique names, so the SFT adapter, each GRPO run's versions and the evaluated adapters
    never collide. Dev mode lets a GRPO run push merged weights (`model.sync: auto` picks them where they
    sample faster on this CPU: docs/performance.md); evaluation loads each adapter as it is. `dtype`: the server's
    precision (auto: the trainer's, float32 on the CPU)."""
    from agent_rl.learn.models import resolve_model
    from agent_rl.rollout.serving.vllm.server import VLLMServer

    return VLLMServer(resolve_model(model), max_lora_rank=16, max_loras=4, kv_cache_gib=kv_cache_gib,
                      max_model_len=max_model_len, dev_mode=True, log_path=out / "vllm.log", startup_timeout_s=900,
                      dtype=dtype)


MERGE = """import sys
from peft import PeftModel
from agent_rl.learn.models import resolve_model
from agent_rl.learn.policy import load_causal_lm
from transformers import AutoTokenizer
base = resolve_model(sys.argv[1])
PeftModel.from_pretrained(load_causal_lm(str(base)), sys.argv[2]).merge_and_unload().save_pretrained(sys.argv[3])
AutoTokenizer.from_pretrained(str(base)).save_pretrained(sys.argv[3])
"""


def merged_weights(model: str, run_dir: Path, out: Path) -> Path:
    """A run's final adapter merged into `model`'s weights, saved as a model folder at `out` (once, in a
    process of its own: several GB of memory back at its end). `agent-rl eval --adapter out` then samples
    it as plain weights on a server of its own: with a LoRA adapter vLLM's CPU build samples a 0.5B
    model far slower (docs/coding-recipe.md#what-a-05b-policy-costs-here)."""
    if not (out / "config.json").is_file():
        code = subprocess.run([sys.executable, "-c", MERGE, model, str(run_dir / "adapter"), str(out)]).returncode
        if code:
            raise StepFailed(f"merging {run_dir}/adapter into {model} exited with {code}")
    return out


def restore_base(server: Any, timeout_s: float = 600.0) -> None:
    """Reload the base model's weights into the shared server, in place (the serving backend's pause, reload and
    resume, as `FullWeightSync` does; the pause waits for requests in flight). A GRPO run that pushed merged
    weights leaves its last policy as the server's weights; the next run and the evaluation load LoRA adapters,
    which must sit on the base."""
    import aiohttp

    from agent_rl.rollout.serving.base import ServerError
    from agent_rl.rollout.serving.choose import serving_backend

    backend, url = serving_backend(), server.url

    async def reload() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
            try:
                await backend.pause(http, url, abort=False)
                await backend.load_weights(http, url, Path(server.model_dir))
            except BaseException:
                with contextlib.suppress(ServerError):
                    await backend.resume(http, url)  # never leave the server paused
                raise
            await backend.resume(http, url)

    try:
        asyncio.run(reload())
    except ServerError as e:
        raise StepFailed(f"restoring the base weights on {url} failed: {e}") from None


def note(wall: dict[str, float | None], key: str, seconds: float | None) -> None:
    """Record a step's wall time; a later try that skipped the step (None) keeps the time measured."""
    if seconds is not None or key not in wall:
        wall[key] = seconds


def finite(x: float | None) -> float | None:
    """A JSON-safe number: NaN and infinities become None."""
    return None if x is None or not math.isfinite(x) else x


def seed_summary(before: Mapping[str, float], after: Mapping[int, Mapping[str, float]],
                 keys: Sequence[str]) -> dict[str, Any]:
    """Per seed: after - before of each figure; over seeds: the smallest gain and the spread (max - min
    of the after figure). A figure that is None (e.g. actions per solved task when none was solved)
    gives None for the gains it enters."""
    out: dict[str, Any] = {"before": {k: before.get(k) for k in keys},
                           "after": {s: {k: a.get(k) for k in keys} for s, a in after.items()}, "gain": {}}
    for seed, a in after.items():
        out["gain"][seed] = {k: None if a.get(k) is None or before.get(k) is None else a[k] - before[k] for k in keys}
    for k in keys:
        gains = [g[k] for g in out["gain"].values() if g[k] is not None]
        afters = [a[k] for a in out["after"].values() if a[k] is not None]
        out[f"{k}_min_gain"] = min(gains) if gains else None
        out[f"{k}_seed_spread"] = max(afters) - min(afters) if afters else None
    return out


def per_step(run_dir: Path, key: str | Callable[[dict], float | None]) -> list[float | None]:
    """One value per step of a run: a metrics.jsonl key, or a function of the step's record."""
    by_step = {r["step"]: r for r in read_metrics(run_dir)}  # a resumed run: the last record of a step wins
    get = key if callable(key) else (lambda r: r.get(key))
    return [finite(get(by_step[s])) for s in sorted(by_step)]


def ratio(num: str, den: str) -> Callable[[dict], float | None]:
    """A per-step rate from two per-rollout means, e.g. refused actions / actions."""
    return lambda r: r[num] / r[den] if r.get(num) is not None and r.get(den) else None


def alarm_steps(run_dir: Path, key: str = "alarm/tool_collapse") -> list[int]:
    """The steps at which an alarm flag was up."""
    return [r["step"] for r in read_metrics(run_dir) if r.get(key) == 1.0]


def mean(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def plot_panels(runs: Mapping[str, Path], panels: Sequence[tuple[str, str | Callable]], path: Path, script: str,
                title: str, styles: Mapping[str, dict] | None = None, alarm: str | None = None) -> Path:
    """A PNG with one panel per (title, metric) and one line per run; the figure names `script`, the
    command that drew it. `styles`: matplotlib keyword arguments per run label; `alarm`: a 0/1 key
    marked with red triangles on the first panel where it fired."""
    from matplotlib.figure import Figure

    cols = 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(5.2 * cols, 2.9 * rows + 0.5), layout="constrained")
    fig.suptitle(f"{title}\n(drawn by {script})", fontsize=10)
    for i, (name, key) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        for label, run_dir in runs.items():
            ys = [math.nan if y is None else y for y in per_step(run_dir, key)]
            ax.plot(range(1, len(ys) + 1), ys, marker=".", label=label, **(styles or {}).get(label, {}))
            if alarm and i == 0 and (fired := alarm_steps(run_dir, alarm)):
                ax.plot(fired, [0.0] * len(fired), "rv", clip_on=False)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("GRPO step", fontsize=8)
        ax.set_ylim(-0.03, 1.03)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=6, loc="best")
    fig.savefig(path, dpi=80)
    return path
