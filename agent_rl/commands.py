"""What each `agent-rl` sub-command does, on top of the library; `cli` parses the arguments.

Owns: one function per command (`rollout`, `train`, `demos`, `bootstrap`, `sft`, `eval` and `eval --benchmark bfcl`,
`play`, `audit-reward`, `plot`, `view`, and the tool services), the mapping of library errors to one
`error: ...` line with an exit status (2 for bad input such as a config, a model path or an environment
name; 1 for a failed run such as an unreachable server), and printing results.
Does not own: argument parsing (`cli`), any logic a library module can own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent_rl.audit.relative import RelativeReport
    from agent_rl.config.train import TrainConfig
    from agent_rl.core.registry import EnvSpec
    from agent_rl.core.renderers.base import Renderer
    from agent_rl.learn.algorithm import AlgorithmConfig

EXIT_BAD_INPUT, EXIT_FAILED = 2, 1
BARE_CALLS = {"auto": "null", "on": "true", "off": "false"}  # rollout --bare-calls -> model.bare_tool_calls


class CLIError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAILED):
        super().__init__(message)
        self.code = code


@contextlib.contextmanager
def errors_as_lines() -> Iterator[None]:
    """Bad input (a config, model or environment the library refuses), server failures (at start, or a
    server that stops answering requests or adapter loads), rollout workers that cannot go on, a checkpoint
    that could not be written, and a training run stopped by SIGTERM / SIGUSR1 (exit status 128 + the signal
    number) as CLIError."""
    from agent_rl.core.config import ConfigError
    from agent_rl.learn.models import ModelError
    from agent_rl.rollout.sampler import SamplerError
    from agent_rl.rollout.serving.base import ServerError
    from agent_rl.rollout.weight_sync.base import WeightSyncError
    from agent_rl.rollout.worker import WorkerError
    from agent_rl.runs.checkpoint import CheckpointError
    from agent_rl.stopping import Preempted

    try:
        yield
    except (ConfigError, ModelError, ValueError) as e:
        raise CLIError(str(e), EXIT_BAD_INPUT) from None
    except (ServerError, SamplerError, WeightSyncError, CheckpointError, WorkerError) as e:  # died mid-run too
        raise CLIError(str(e)) from None
    except Preempted as e:  # SIGTERM / SIGUSR1 during training: checkpointed, servers stopped
        raise CLIError(str(e), e.code) from None


def config(args: argparse.Namespace, extra: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """The YAML file `args.config` (or the defaults) with `--set` overrides, then `extra` ones."""
    from agent_rl.config.file import load_config

    with errors_as_lines():
        return load_config(args.config, [*(args.set or []), *extra])


def announce_server(cfg: TrainConfig) -> None:
    if not cfg.sampler.server_urls:
        print(f"starting a vLLM server for {cfg.model.name} (about a minute on a CPU)...", file=sys.stderr)


def default_report(kind: str) -> Path:
    """Where an evaluation's report goes without --out: runs/eval/<kind>-<date>-<time>.json."""
    return Path("runs") / "eval" / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def _rounded(metrics: dict[str, float]) -> str:
    return json.dumps({k: round(v, 4) for k, v in metrics.items()})


def rollout(args: argparse.Namespace) -> int:
    from agent_rl.rollout.engine import play_groups
    from agent_rl.rollout.runner import EpisodeLimits
    from agent_rl.runs.display import format_trajectory
    from agent_rl.runs.metrics import rollout_metrics
    from agent_rl.session import episodes, open_session, sampling

    urls = f"[{','.join(args.server_url)}]" if args.server_url else "[]"
    cfg = config(argparse.Namespace(config=None, set=[
        f"model.name={args.model}", f"model.renderer={args.renderer}", f"rollout.env={args.env}",
        f"rollout.env_args={args.env_args}", f"model.bare_tool_calls={BARE_CALLS[args.bare_calls]}",
        f"rollout.max_turns={args.max_turns}",
        f"rollout.max_tokens_per_turn={args.max_tokens}", f"rollout.max_total_tokens={args.max_total_tokens}",
        f"sampler.temperature={args.temperature}", f"sampler.request_timeout_s={args.request_timeout}",
        f"sampler.server_urls={urls}", f"rollout.workers={args.workers}"]))
    with errors_as_lines():
        session = open_session(cfg)
    try:
        tasks = session.env.load_tasks(args.tasks, seed=args.seed, split=args.split)
    except Exception as e:
        raise CLIError(f"environment {args.env!r} could not load tasks: {type(e).__name__}: {e}",
                       EXIT_BAD_INPUT) from None
    limits = EpisodeLimits.from_config(cfg.rollout, cfg.sampler.temperature)

    async def run():
        async with sampling(session) as served:  # --workers: the episodes play on Ray workers
            return await play_groups(tasks, episodes(session, served.players, limits, args.group_size),
                                     cfg.rollout.max_concurrent)

    announce_server(cfg)
    with errors_as_lines():
        groups = asyncio.run(run())
    trajs = [t for g in groups for t in g.trajectories]
    for g in groups:
        for i, t in enumerate(g.trajectories):
            title = f"{g.task_id} #{i + 1}/{len(g.trajectories)}"
            print(format_trajectory(t, session.renderer, title, sys.stdout.isatty()), "\n")
    print(_rounded(rollout_metrics(trajs)))
    failed = [t for t in trajs if t.infra_error]
    if failed:
        raise CLIError(f"{len(failed)} of {len(trajs)} rollouts failed; first: {failed[0].error}")
    return 0


def train(args: argparse.Namespace) -> int:
    cfg = config(args)
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return torchrun(args)
    from agent_rl.runs.runlog import RunLogError, read_metrics
    from agent_rl.runs.summary import run_table, where
    from agent_rl.trainer import train as run_training

    with errors_as_lines():
        asyncio.run(run_training(cfg, resume=args.resume))
    if os.environ.get("RANK", "0") != "0":
        return 0  # rank 0 reports
    run_dir = Path(cfg.run.run_dir)
    curves = []
    if args.plot:
        from agent_rl.runs.plot import plot_run

        curves = plot_run(run_dir)
    try:
        print(run_table(read_metrics(run_dir)))
    except RunLogError:  # no step was logged (a run resumed after its last step)
        pass
    adapter = run_dir / "adapter"
    print(where(metrics=run_dir / "metrics.jsonl", curves=", ".join(map(str, curves)),
                adapter=adapter if adapter.is_dir() else None))
    return 0


def torchrun(args: argparse.Namespace) -> int:
    """`agent-rl train --nproc N ...`: the same command as N ranks under torchrun (torch.distributed.run),
    on this machine, or across machines with --nnodes, --node-rank and --rdzv-endpoint."""
    launcher = ("--nproc", "--nnodes", "--node-rank", "--rdzv-endpoint")
    argv, skip = [], False
    for a in sys.argv[1:]:  # this command line without the launcher's own flags (each with its value)
        if skip:
            skip = False
        elif a in launcher:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in launcher)):
            argv.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", f"--nnodes={args.nnodes}"]
    if args.nnodes > 1:
        if not args.rdzv_endpoint:
            raise CLIError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every machine)", EXIT_BAD_INPUT)
        cmd += [f"--node_rank={args.node_rank}", "--rdzv_backend=c10d", f"--rdzv_endpoint={args.rdzv_endpoint}"]
    else:
        cmd += ["--standalone"]
    code = subprocess.run([*cmd, "-m", "agent_rl.cli", *argv]).returncode
    if code:
        raise CLIError(f"torchrun ended with status {code}: the first failing rank's error is above")
    return 0


def demos(args: argparse.Namespace) -> int:
    from agent_rl.demos import make_demos, write_demos
    from agent_rl.rollout.runner import EpisodeLimits
    from agent_rl.session import open_session

    cfg = config(args)
    s = cfg.sft
    out = args.out or s.demos
    with errors_as_lines():
        session = open_session(cfg)
        made, stats = asyncio.run(make_demos(session.env, session.renderer, s.num_demos, seed=cfg.run.seed,
                                             direct_share=s.direct_share, imperfect_share=s.imperfect_share,
                                             limits=EpisodeLimits.from_config(cfg.rollout)))
    if not made:
        raise CLIError(f"the {session.env.name!r} solver solved none of {s.num_demos} tasks within the rollout limits")
    write_demos(out, made)
    print(json.dumps({"path": str(out), **{k: round(v, 4) for k, v in stats.items()}}))
    return 0


def bootstrap(args: argparse.Namespace) -> int:
    from agent_rl.bootstrap import Help, bootstrap, help_from_file, in_parts
    from agent_rl.core.files import write_lines
    from agent_rl.demos import demo_lines
    from agent_rl.rollout.players import LocalPlayers
    from agent_rl.rollout.runner import EpisodeLimits
    from agent_rl.session import open_session, sampling

    cfg = config(args)
    out = args.out or cfg.sft.demos
    with errors_as_lines():
        help_ = help_from_file(args.hint) if args.hint else Help()
        session = open_session(cfg)
        if args.force_call:
            help_ = Help(help_.hint, help_.example, tuple(session.renderer.call_opening()))
        tasks = session.env.load_tasks(args.tasks or cfg.sft.num_demos, seed=cfg.run.seed, split="train")
        limits = EpisodeLimits.from_config(cfg.rollout, cfg.sampler.temperature, cfg.sampler.top_p, seed=cfg.run.seed)

        parts = Path(f"{out}.parts")  # a killed bootstrap goes on from here (in_parts)

        async def run():  # the episodes play here: each environment wrapped with the help
            async with sampling(session) as served:
                async def part(some: Sequence[dict[str, Any]]) -> tuple[list[str], dict[str, float]]:
                    made, stats = await bootstrap(
                        session.env, session.renderer,
                        lambda make_env: LocalPlayers(make_env, served.sampler, session.renderer), some,
                        args.samples, limits, help_, cfg.eval.success_threshold, cfg.rollout.max_concurrent)
                    return demo_lines(made), stats

                # parts of as many episodes as play at once
                return await in_parts(part, tasks, max(1, cfg.rollout.max_concurrent // args.samples), parts)

        announce_server(cfg)
        made, stats = asyncio.run(run())
    if not made:
        raise CLIError(f"no episode of {int(stats['played'])} used a tool and solved its task: nothing to learn "
                       f"from (failed {stats['failed']:.2f}, attempted {stats['attempted']:.2f}, solved "
                       f"{stats['solved']:.2f}); try --force-call or a hint")
    write_lines(out, made)
    parts.unlink(missing_ok=True)
    print(json.dumps({"path": str(out), **{k: round(v, 4) for k, v in stats.items()}}))
    return 0


def sft(args: argparse.Namespace) -> int:
    cfg = config(args)
    from agent_rl.sft import sft as run_sft

    with errors_as_lines():
        final = run_sft(cfg, resume=args.resume)
    if args.plot:
        from agent_rl.runs.plot import plot_run

        plot_run(cfg.sft.run_dir)
    print(_rounded(final))
    return 0


def evaluate(args: argparse.Namespace) -> int:
    from agent_rl.core.files import write_json
    from agent_rl.evaluation.evaluate import env_verdict, resolve_policy
    from agent_rl.evaluation.evaluate import evaluate as run_eval
    from agent_rl.rollout.serving.choose import serving_backend
    from agent_rl.runs.display import format_trajectory
    from agent_rl.runs.replies import replies_path, write_replies
    from agent_rl.runs.summary import policy_table, where
    from agent_rl.session import open_session

    if args.benchmark:
        return benchmark(args)
    if args.categories is not None or args.per_category is not None:
        raise CLIError("--categories and --per-category choose a benchmark's questions: add --benchmark bfcl",
                       EXIT_BAD_INPUT)
    extra = [f"eval.samples={args.n}"] * (args.n is not None) + [f"eval.tasks={args.tasks}"] * (args.tasks is not None)
    cfg = config(args, extra)
    adapters = args.adapter or ["base"]
    if len(set(adapters)) != len(adapters):
        raise CLIError(f"--adapter given twice: {adapters}", EXIT_BAD_INPUT)
    groups: dict[str, Any] = {}
    with errors_as_lines():
        for a in adapters:
            resolve_policy(a)
        session = open_session(cfg)
        announce_server(cfg)
        backend = serving_backend()

        def serve(model_dir):  # saved full weights have no tokenizer files: the base model's
            return backend.serve(cfg.model, cfg.sampler, cfg.run.seed, model_dir,
                                 tokenizer=None if model_dir == session.model_dir else session.model_dir)

        report = asyncio.run(run_eval(session, adapters, serve, groups))
    for label, gs in groups.items():
        for g in gs[: args.show]:
            print(format_trajectory(g.trajectories[0], session.renderer, f"{label}: {g.task_id}",
                                    sys.stdout.isatty()), "\n")
    out = write_json(args.out or default_report("eval"), report)
    threshold = cfg.eval.success_threshold
    replies = write_replies(replies_path(out), {label: [(t, env_verdict(t, threshold)) for g in gs
                                                        for t in g.trajectories] for label, gs in groups.items()},
                            session.renderer)
    print(policy_table(report["results"], baseline=adapters[0] if len(adapters) > 1 else None))
    print(where(report=out, replies=f"{replies} (browse them: agent-rl view {replies})"))
    failed = sum(r["infra_error_rate"] > 0 for r in report["results"].values())
    if failed:
        raise CLIError(f"{failed} evaluation(s) had infrastructure errors: see infra_error_rate")
    return 0


def benchmark(args: argparse.Namespace) -> int:
    """`agent-rl eval --benchmark bfcl`: the config's model (and `--adapter`s) on BFCL, judged by bfcl-eval."""
    from agent_rl.core.files import write_json
    from agent_rl.evaluation.bfcl import bfcl_settings, evaluate_bfcl, format_table
    from agent_rl.evaluation.bfcl_checker import BFCLError
    from agent_rl.rollout.serving.choose import serving_backend
    from agent_rl.runs.replies import replies_path, write_replies
    from agent_rl.runs.summary import where
    from agent_rl.session import open_session

    for flag, value in (("--tasks", args.tasks), ("--show", args.show or None)):
        if value is not None:
            raise CLIError(f"{flag} does not apply to --benchmark bfcl (choose the questions with --categories and "
                           "--per-category, the episodes of each with --n)", EXIT_BAD_INPUT)
    cfg = config(args)
    adapters = args.adapter or ["base"]
    if len(set(adapters)) != len(adapters):
        raise CLIError(f"--adapter given twice: {adapters}", EXIT_BAD_INPUT)
    judged: dict[str, Any] = {}
    with errors_as_lines():
        settings = bfcl_settings(categories=args.categories, per_category=args.per_category, samples=args.n)
        session = open_session(cfg)
        announce_server(cfg)
        try:
            report = asyncio.run(evaluate_bfcl(session, adapters, functools.partial(
                serving_backend().serve, cfg.model, cfg.sampler, cfg.run.seed), settings, judged_out=judged))
        except BFCLError as e:
            raise CLIError(str(e)) from None
    out = write_json(args.out or default_report("bfcl"), report)
    replies = write_replies(replies_path(out), {label: [(traj, verdict) for _, traj, verdict in rows]
                                                for label, rows in judged.items()}, session.renderer)
    print(format_table(report))
    print(where(report=out, replies=f"{replies} (browse them: agent-rl view {replies})"))
    failed = [f for r in report["results"].values() for f in r.values() if f["infra_errors"]]
    if failed:
        raise CLIError(f"{sum(f['infra_errors'] for f in failed)} BFCL question(s) ended in an infrastructure error "
                       f"(counted wrong); first: {failed[0]['first_infra_error']}")
    return 0


def play(args: argparse.Namespace) -> int:
    from agent_rl.play import play as play_episode
    from agent_rl.play import summary
    from agent_rl.session import open_session

    cfg = config(argparse.Namespace(config=None, set=[f"model.name={args.model}", f"rollout.env={args.env}"]))
    with errors_as_lines():
        session = open_session(cfg)
        tasks = session.env.load_tasks(args.task + 1, seed=args.seed, split=args.split)
    task = tasks[args.task]
    if sys.stdin.isatty():
        print("Type the assistant's reply; end it with a line holding only '.'. "
              "Shortcuts: /call NAME {json arguments}, /quit.", file=sys.stderr)
    traj = asyncio.run(play_episode(session.env, task, session.renderer, sys.stdin,
                                    lambda text: print(text, end="", flush=True)))
    print()
    print(json.dumps(summary(traj)))
    return 0 if not traj.infra_error else EXIT_FAILED


def _key_value(item: str, option: str) -> tuple[str, Any]:
    """`KEY=VALUE` with VALUE read as YAML (`true`, `[1, 2]`, `bare`); ValueError naming `option`."""
    import yaml

    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"{option} {item}: expected KEY=VALUE, e.g. turn_rewards=true")
    try:
        return key.strip(), yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ValueError(f"{option} {item}: invalid YAML value {raw!r}: {getattr(e, 'problem', None) or e}") from None


def audit_reward(args: argparse.Namespace) -> int:
    from agent_rl.audit.play import audit_env
    from agent_rl.audit.report import format_matrix, format_report
    from agent_rl.config.file import load_config
    from agent_rl.core.files import write_json
    from agent_rl.core.registry import load_env
    from agent_rl.core.renderers.choose import load_renderer
    from agent_rl.learn.models import resolve_model

    if args.tasks < 1:
        raise CLIError(f"--tasks must be at least 1 (got {args.tasks})", EXIT_BAD_INPUT)
    if args.set and args.relative is None:
        raise CLIError("--set overrides the --relative config: add --relative", EXIT_BAD_INPUT)
    with errors_as_lines():
        env_args = dict(_key_value(item, "--env-arg") for item in args.env_arg)
        specs = [load_env(name).with_task_args(env_args) for name in args.env]
        renderer = load_renderer(resolve_model(args.model))
        algo = None if args.relative is None else load_config(args.relative or None, args.set).algorithm
    reports = []
    for spec in specs:
        try:
            reports.append(asyncio.run(audit_env(spec, renderer, args.tasks, args.seed, args.split)))
        except ValueError as e:  # nothing to audit, or tasks the environment refuses to give
            raise CLIError(str(e), EXIT_BAD_INPUT) from None
        except RuntimeError as e:  # the environment could not start
            raise CLIError(str(e)) from None
        print(format_report(reports[-1]), end="\n\n")
    if len(reports) > 1:
        print(format_matrix(reports))
    relative = [] if algo is None else [_audit_relative(spec, renderer, args, algo) for spec in specs]
    if args.json_out:
        write_json(args.json_out, [r.to_json() for r in reports] + [r.to_json() for r in relative])
    failed = [line for line in [r.failure_line() for r in reports] + [r.failure_line() for r in relative] if line]
    if failed:
        raise CLIError("reward audit failed: " + "; ".join(failed))
    return 0


def _audit_relative(spec: EnvSpec, renderer: Renderer, args: argparse.Namespace, algo: AlgorithmConfig
                    ) -> RelativeReport:
    """The relative audit of one environment (`audit.relative`), its table printed."""
    from agent_rl.audit.relative import format_relative, judge_relative, play_relative

    try:
        played = asyncio.run(play_relative(spec, renderer, args.tasks, args.seed, args.split))
    except ValueError as e:
        raise CLIError(str(e), EXIT_BAD_INPUT) from None
    report = judge_relative(spec.name, played, algo)
    print(format_relative(report), end="\n\n")
    return report


def plot(args: argparse.Namespace) -> int:
    from agent_rl.runs.plot import plot_run

    try:
        paths = plot_run(args.run_dir)
    except (FileNotFoundError, ValueError) as e:
        raise CLIError(str(e), EXIT_BAD_INPUT) from None
    print("\n".join(str(p) for p in paths))
    return 0


def view(args: argparse.Namespace) -> int:
    from agent_rl.runs.view import parse_steps, write_page

    try:
        path = write_page(args.run_dir, args.out, parse_steps(args.steps))
    except (ValueError, OSError) as e:  # TraceError is a ValueError: no run, no traces, no such steps
        raise CLIError(str(e), EXIT_BAD_INPUT) from None
    print(path)
    return 0


def sandbox_exec(args: argparse.Namespace) -> int:
    from agent_rl.tools.sandbox import exec_cli

    return exec_cli(args.file, args.backend)


def kg_serve(args: argparse.Namespace) -> int:
    from agent_rl.tools.kg_service import kg_serve_cli

    return kg_serve_cli(args.host, args.port, args.db)


def search_query(args: argparse.Namespace) -> int:
    from agent_rl.tools.search import search_cli

    return search_cli(" ".join(args.text), args.k, args.index)
