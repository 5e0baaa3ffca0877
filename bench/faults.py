"""What faults cost a real training run: its vLLM server SIGKILLed twice, and an environment error in 5% of
episodes, against the same run untouched, side by side in one invocation (#26's benchmark).

Owns: the two runs (`train`: `agent-rl train` of examples/calculator_grpo.yaml, its server found and killed at
the given offsets), where the kills fall, and the comparison.
Does not own: the faulted environment (bench/flaky_env.py: the calculator, raising as it starts in `--env-errors`
of its episodes, retried by `rollout.on_error: retry`), the restarts and replays (agent_rl's).

The untouched run goes first; the faulted run's server (its leader, as an out-of-memory kill ends it) is
SIGKILLed at `--kills` points drawn with `--seed` over the first two thirds of the untouched run's training span
(from its server answering its health probe to its end), at the same offsets from the faulted run's server
answering; a kill that finds the server still restarting waits until the run says it is back. What it reports
and has measured: docs/performance.md#the-bench-scripts.

    python bench/faults.py [--steps 6] [--kills 2] [--env-errors 0.05] [--seed 0] [--model smollm2-135m]
                           [--set KEY=VALUE ...] [--out DIR]
(progress on stderr; one JSON line of figures on stdout)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp

from agent_rl.rollout.serving.choose import serving_backend

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "calculator_grpo.yaml"


def say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def server_of(run: subprocess.Popen) -> tuple[int, str] | None:
    """(pid, base URL) of the run's vLLM server process, if one runs now."""
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if int(stat[1]) == run.pid and stat[0] != "Z" and b"vllm.entrypoints.openai.api_server" in cmd:
            port = cmd[cmd.index(b"--port") + 1].decode()
            return int(p), f"http://127.0.0.1:{port}"
    return None


def answering(url: str) -> bool:
    """Whether the server at `url` answers the serving backend's health probe within 2 s."""
    async def probe() -> bool:
        async with aiohttp.ClientSession() as http:
            return await serving_backend().health(http, url, 2.0)

    return asyncio.run(probe())


def wait_for_server(run: subprocess.Popen, deadline: float) -> tuple[int, str] | None:
    """The run's server once it answers its health probe (None if the run ended first)."""
    while time.monotonic() < deadline and run.poll() is None:
        found = server_of(run)
        if found is not None and answering(found[1]):
            return found
        time.sleep(0.2)
    return None


def back(stderr: Path) -> int:
    """How many times the run has said a server is back in service (`rollout.supervisor`)."""
    return stderr.read_text(errors="replace").count(" is back, ") if stderr.is_file() else 0


def train(run_dir: Path, sets: list[str], kill_offsets: list[float], env: dict[str, str]) -> dict:
    """One `agent-rl train` run; SIGKILLs its server at `kill_offsets` seconds after the server first answered."""
    cmd = [sys.executable, "-m", "agent_rl.cli", "train", str(CONFIG), "--no-plot",
           *[x for s in [*sets, f"run.run_dir={run_dir}"] for x in ("--set", s)]]
    t0 = time.monotonic()
    log = open(run_dir.with_suffix(".stderr"), "w")
    run = subprocess.Popen(cmd, stderr=log, stdout=subprocess.DEVNULL, env={**os.environ, **env}, cwd=ROOT)
    try:
        first = wait_for_server(run, t0 + 900)
        startup = time.monotonic() - t0
        say(f"  {run_dir.name}: server answering after {startup:.1f} s")
        kills = []
        for offset in kill_offsets:
            while run.poll() is None and (time.monotonic() < t0 + startup + offset
                                          or back(run_dir.with_suffix(".stderr")) < len(kills)):
                time.sleep(0.1)
            target = wait_for_server(run, time.monotonic() + 900) if first else None
            if target is None:
                break
            os.kill(target[0], signal.SIGKILL)
            kills.append(round(time.monotonic() - t0 - startup, 1))
            say(f"  {run_dir.name}: SIGKILLed its server (pid {target[0]}) {kills[-1]} s into training")
        run.wait(timeout=7200)
    finally:
        if run.poll() is None:
            run.kill()
        log.close()
    wall = time.monotonic() - t0
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] \
        if (run_dir / "metrics.jsonl").is_file() else []
    total = {k: sum(m.get(k, 0.0) for m in metrics) for k in
             ("fault/restarts", "fault/down_s", "fault/replayed_episodes", "error/retried")}
    errors = sum(v for m in metrics for k, v in m.items() if k.startswith("error/")
                 and k not in ("error/retried", "error/dropped_groups"))
    say(f"  {run_dir.name}: exit {run.returncode}, {len(metrics)} steps, {wall:.1f} s")
    return {"exit": run.returncode, "steps": len(metrics), "wall_s": wall, "startup_s": startup, "kills_at_s": kills,
            "env_errors": errors, **total}


def trained_tokens(run_dir: Path) -> list[list[list[int]]]:
    return [[seg["token_ids"] for line in path.read_text().splitlines() for seg in json.loads(line)["segments"]]
            for path in sorted((run_dir / "traces").glob("*.jsonl"))]


def same_adapter(a: Path, b: Path) -> tuple[bool, float]:
    import torch
    from safetensors.torch import load_file

    x, y = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (a, b))
    return all(torch.equal(x[k], y[k]) for k in x), max(float((x[k] - y[k]).abs().max()) for k in x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--kills", type=int, default=2, help="SIGKILLs of the faulted run's server")
    ap.add_argument("--env-errors", type=float, default=0.05, help="share of episodes whose environment raises")
    ap.add_argument("--seed", type=int, default=0, help="where the kills fall, which episodes fail")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--set", action="append", default=[], help="more config overrides, KEY=VALUE")
    ap.add_argument("--out", type=Path, help="where the runs go (default: a temporary folder)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-faults-"))
    out.mkdir(parents=True, exist_ok=True)
    sets = [f"model.name={args.model}", f"run.steps={args.steps}", "run.save_every=3", "run.tensorboard=false",
            "rollout.on_error=retry", "run.trace_groups=1000", *args.set]  # every group traced: its tokens compared
    say(f"untouched run ({args.steps} steps) in {out}")
    clean = train(out / "untouched", [*sets, "rollout.env=calculator"], [], {})
    span = clean["wall_s"] - clean["startup_s"]
    rng = random.Random(args.seed)
    offsets = sorted(rng.uniform(0.05, 2 / 3) * span for _ in range(args.kills))
    say(f"faulted run: kills at {[round(o, 1) for o in offsets]} s into training, env errors in "
        f"{args.env_errors:.0%} of episodes")
    flaky = {"AGENT_RL_FLAKY_SHARE": str(args.env_errors), "AGENT_RL_FLAKY_SEED": str(args.seed)}
    faulted = train(out / "faulted", [*sets, f"rollout.env={ROOT / 'bench' / 'flaky_env.py'}"], offsets, flaky)
    done = faulted["exit"] == clean["exit"] == 0
    equal, gap = same_adapter(out / "untouched", out / "faulted") if done else (False, float("nan"))
    same_tokens = done and trained_tokens(out / "untouched") == trained_tokens(out / "faulted")
    figures = {
        "steps": args.steps, "steps_done_untouched": clean["steps"], "steps_done_faulted": faulted["steps"],
        "exit_faulted": faulted["exit"], "wall_s_untouched": round(clean["wall_s"], 1),
        "wall_s_faulted": round(faulted["wall_s"], 1), "wall_ratio": round(faulted["wall_s"] / clean["wall_s"], 3),
        "startup_s_untouched": round(clean["startup_s"], 1), "startup_s_faulted": round(faulted["startup_s"], 1),
        "wall_ratio_without_startup": round((faulted["wall_s"] - faulted["startup_s"]) / span, 3),
        "down_s": round(faulted["fault/down_s"], 1),
        "wall_ratio_without_any_server_start": round(
            (faulted["wall_s"] - faulted["startup_s"] - faulted["fault/down_s"]) / span, 3),
        "kills_at_s": faulted["kills_at_s"], "restarts": faulted["fault/restarts"],
        "replayed_episodes": faulted["fault/replayed_episodes"], "env_errors": faulted["env_errors"],
        "env_retries": faulted["error/retried"], "trained_tokens_equal_untouched": same_tokens,
        "adapter_equal_untouched": equal, "adapter_max_abs_diff": gap,
        "out": str(out),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
