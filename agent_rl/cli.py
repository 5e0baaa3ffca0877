"""The `agent-rl` command line: thin argument parsing over the library.

Owns: sub-commands and the rule that bad input ends in one `error: ...` line and a non-zero exit
(2 for bad input such as a config or a path, 1 for a failed run such as an unreachable server).
Does not own: any logic beyond wiring.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import Any

EXIT_BAD_INPUT, EXIT_FAILED = 2, 1


class CLIError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAILED):
        super().__init__(message)
        self.code = code


# -- rollout ---------------------------------------------------------------------------------------
def _serve_or_attach(model_dir: Any, urls: list[str] | None, max_lora_rank: int = 16, **server_args: Any):
    """A context manager yielding the list of server URLs: attached, or one server started here."""
    import contextlib

    from agent_rl.server import ServerError, VLLMServer, attach

    @contextlib.contextmanager
    def ctx():
        try:
            if urls:
                yield [attach(u) for u in urls]
                return
            print(f"starting vLLM server on {model_dir} (about a minute on a CPU)...", file=sys.stderr)
            with VLLMServer(model_dir, max_lora_rank=max_lora_rank, **server_args) as server:
                yield [server.url]
        except ServerError as e:
            raise CLIError(str(e)) from None

    return ctx()


def cmd_rollout(args: argparse.Namespace) -> int:
    from agent_rl.chat import ChatRenderer
    from agent_rl.display import format_trajectory
    from agent_rl.metrics import rollout_metrics
    from agent_rl.models import ModelError, resolve_model
    from agent_rl.rollout import EpisodeLimits, rollout_groups
    from agent_rl.sampler import VLLMSampler
    from envs.registry import load_env

    try:
        spec = load_env(args.env)
        model_dir = resolve_model(args.model)
    except (ValueError, ModelError) as e:
        raise CLIError(str(e), EXIT_BAD_INPUT) from None
    try:
        tasks = spec.load_tasks(args.tasks, seed=args.seed, split=args.split)
    except Exception as e:
        raise CLIError(f"environment {args.env!r} could not load tasks: {type(e).__name__}: {e}", EXIT_BAD_INPUT)
    renderer = ChatRenderer.from_pretrained(model_dir)
    limits = EpisodeLimits(max_turns=args.max_turns, max_tokens_per_turn=args.max_tokens,
                           max_total_tokens=args.max_total_tokens, temperature=args.temperature)

    async def run(urls: list[str]):
        async with VLLMSampler(urls, request_timeout_s=args.request_timeout) as sampler:
            return await rollout_groups(tasks, spec.make_env, sampler, renderer, limits, args.group_size)

    with _serve_or_attach(model_dir, args.server_url) as urls:
        groups = asyncio.run(run(urls))
    trajs = [t for g in groups for t in g.trajectories]
    color = sys.stdout.isatty()
    for g in groups:
        for i, t in enumerate(g.trajectories):
            print(format_trajectory(t, renderer, f"{g.task_id} #{i + 1}/{len(g.trajectories)}", color), "\n")
    print(json.dumps({k: round(v, 4) for k, v in rollout_metrics(trajs).items()}))
    failed = [t for t in trajs if t.infra_error]
    if failed:
        raise CLIError(f"{len(failed)} of {len(trajs)} rollouts failed; first: {failed[0].error}")
    return 0


# -- train / plot ----------------------------------------------------------------------------------
def cmd_train(args: argparse.Namespace) -> int:
    from agent_rl.models import ModelError
    from agent_rl.server import ServerError

    cfg = _config(args)
    from agent_rl.trainer import train

    try:
        final = asyncio.run(train(cfg, resume=args.resume))
    except (ModelError, ValueError) as e:
        raise CLIError(str(e), EXIT_BAD_INPUT) from None
    except ServerError as e:
        raise CLIError(str(e)) from None
    if args.plot:
        from agent_rl.plot import plot_run

        plot_run(cfg.run.run_dir)
    print(json.dumps({k: round(v, 4) for k, v in final.items()}))
    return 0


def _config(args: argparse.Namespace):
    from agent_rl.config import ConfigError, load_config

    try:
        return load_config(args.config, args.set or [])
    except ConfigError as e:
        raise CLIError(str(e), EXIT_BAD_INPUT) from None


# -- cold start, evaluation, play ----------------------------------------------------------------------
def cmd_demos(args: argparse.Namespace) -> int:
    from agent_rl.chat import ChatRenderer
    from agent_rl.demos import make_demos, write_demos
    from agent_rl.models import ModelError, resolve_model
    from agent_rl.rollout import EpisodeLimits
    from envs.registry import load_env

    cfg = _config(args)
    s, r = cfg.sft, cfg.rollout
    out = args.out or s.demos
    try:
        spec = load_env(r.env)
        renderer = ChatRenderer.from_pretrained(resolve_model(cfg.model.name))
        limits = EpisodeLimits(max_turns=r.max_turns, max_tokens_per_turn=r.max_tokens_per_turn,
                               max_total_tokens=r.max_total_tokens)
        demos, stats = asyncio.run(make_demos(spec, renderer, s.num_demos, seed=cfg.run.seed,
                                              direct_share=s.direct_share, limits=limits))
    except (ValueError, ModelError) as e:
        raise CLIError(str(e), EXIT_BAD_INPUT) from None
    if not demos:
        raise CLIError(f"the {r.env!r} solver solved none of {s.num_demos} tasks within the rollout limits")
    write_demos(out, demos)
    print(json.dumps({"path": str(out), **{k: round(v, 4) for k, v in stats.items()}}))
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from agent_rl.models import ModelError

    cfg = _config(args)
    from agent_rl.sft import sft

    try:
        final = sft(cfg, resume=args.resume)
    except (ModelError, ValueError) as e:
        raise CLIError(str(e), EXIT_BAD_INPUT) from None
    if args.plot:
        from agent_rl.plot import plot_run

        plot_run(cfg.sft.run_dir)
    print(json.dumps({k: round(v, 4) for k, v in final.items()}))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from agent_rl.display import format_trajectory
    from agent_rl.evaluate import evaluate, resolve_adapter
    from agent_rl.models import ModelError, resolve_model
    from agent_rl.runlog import write_json

    overrides = list(args.set or [])
    overrides += [f"eval.samples={args.n}"] if args.n is not None else []
    overrides += [f"eval.tasks={args.tasks}"] if args.tasks is not None else []
    args.set = overrides
    cfg = _config(args)
    adapters = args.adapter or ["base"]
    if len(set(adapters)) != len(adapters):
        raise CLIError(f"--adapter given twice: {adapters}", EXIT_BAD_INPUT)
    try:
        for a in adapters:
            resolve_adapter(a)
        from envs.registry import load_env

        load_env(cfg.rollout.env)
        model_dir = resolve_model(cfg.model.name)
    except (ValueError, ModelError) as e:
        raise CLIError(str(e), EXIT_BAD_INPUT) from None
    groups: dict[str, Any] = {}
    with _serve_or_attach(model_dir, cfg.sampler.server_urls, max(cfg.model.lora_rank, 8),
                          kv_cache_gib=cfg.sampler.kv_cache_gib, max_model_len=cfg.sampler.max_model_len) as urls:
        try:
            report = asyncio.run(evaluate(cfg, adapters, urls, groups))
        except ValueError as e:
            raise CLIError(str(e), EXIT_BAD_INPUT) from None
    if args.show:
        from agent_rl.chat import ChatRenderer

        renderer = ChatRenderer.from_pretrained(model_dir)
        for label, gs in groups.items():
            for g in gs[: args.show]:
                print(format_trajectory(g.trajectories[0], renderer, f"{label}: {g.task_id}", sys.stdout.isatty()), "\n")
    if args.out:
        write_json(args.out, report)
    print(format_report(report))
    print(json.dumps(report))
    failed = sum(r["infra_error_rate"] > 0 for r in report["results"].values())
    if failed:
        raise CLIError(f"{failed} evaluation(s) had infrastructure errors: see infra_error_rate")
    return 0


def format_report(report: dict[str, Any]) -> str:
    """The figures of each adapter side by side (and their difference for two), one row per figure."""
    results = report["results"]
    labels = list(results)
    keys = [k for k in ("accuracy", *sorted(k for k in results[labels[0]] if k.startswith("pass@")),
                        "tool_use_rate", "accuracy_with_tools", "accuracy_without_tools", "tool_calls_per_traj",
                        "tool_failure_rate", "turns_mean", "sampled_tokens_mean", "truncation_rate",
                        "infra_error_rate") if k in results[labels[0]]]
    keys += sorted(k for k in results[labels[0]] if k.startswith("tool/") and k.endswith("rate"))
    head = [""] + [_short(lb) for lb in labels] + (["delta"] if "delta" in report else [])
    rows = [head] + [[k] + [f"{results[lb].get(k, float('nan')):.3f}" for lb in labels]
                     + ([f"{report['delta'].get(k, float('nan')):+.3f}"] if "delta" in report else []) for k in keys]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def _short(label: str, width: int = 28) -> str:
    return label if len(label) <= width else "..." + label[-(width - 3):]


def cmd_play(args: argparse.Namespace) -> int:
    from agent_rl.chat import ChatRenderer
    from agent_rl.models import ModelError, resolve_model
    from agent_rl.play import play, summary
    from envs.registry import load_env

    try:
        spec = load_env(args.env)
        renderer = ChatRenderer.from_pretrained(resolve_model(args.model))
        tasks = spec.load_tasks(args.task + 1, seed=args.seed, split=args.split)
    except (ValueError, ModelError) as e:
        raise CLIError(str(e), EXIT_BAD_INPUT) from None
    task = tasks[args.task]
    if sys.stdin.isatty():
        print("Type the assistant's reply; end it with a line holding only '.'. "
              "Shortcuts: /call NAME {json arguments}, /quit.", file=sys.stderr)
    traj = asyncio.run(play(spec, task, renderer, sys.stdin, lambda text: print(text, end="", flush=True)))
    print()
    print(json.dumps(summary(traj)))
    return 0 if not traj.infra_error else EXIT_FAILED


def cmd_plot(args: argparse.Namespace) -> int:
    from agent_rl.plot import plot_run

    try:
        paths = plot_run(args.run_dir)
    except (FileNotFoundError, ValueError) as e:
        raise CLIError(str(e), EXIT_BAD_INPUT) from None
    print("\n".join(str(p) for p in paths))
    return 0


# -- tools ------------------------------------------------------------------------------------------
def cmd_sandbox_exec(args: argparse.Namespace) -> int:
    from tools.sandbox import exec_cli

    return exec_cli(args.file, args.backend)


def cmd_kg_serve(args: argparse.Namespace) -> int:
    from tools.kg_service import kg_serve_cli

    return kg_serve_cli(args.host, args.port, args.db)


def cmd_search_query(args: argparse.Namespace) -> int:
    from tools.search import search_cli

    return search_cli(" ".join(args.text), args.k, args.index)


# -- wiring ------------------------------------------------------------------------------------------
def _config_arguments(p: argparse.ArgumentParser, uses: str, example: str) -> None:
    """The CONFIG file and its --set overrides, read by `_config`."""
    p.add_argument("config", nargs="?", help=uses)
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help=f"override, e.g. {example}")


def _run_arguments(p: argparse.ArgumentParser, checkpoints: str) -> None:
    """What a training command (train, sft) offers beyond its config."""
    p.add_argument("--resume", action="store_true", help=f"continue from {checkpoints}")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip writing PNG curves at the end")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agent-rl", description="Multi-turn tool-use GRPO for LLM agents.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("rollout", help="play an environment with a model and print the trajectories")
    r.add_argument("--env", default="calculator", help="built-in name or module path")
    r.add_argument("--model", default="smollm2-135m", help="folder, hub id, .gguf file, or smollm2-135m")
    r.add_argument("--server-url", action="append", help="attach to running vLLM server(s) instead of starting one")
    r.add_argument("--tasks", type=int, default=2)
    r.add_argument("--group-size", type=int, default=2)
    r.add_argument("--split", default="train")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--max-turns", type=int, default=4)
    r.add_argument("--max-tokens", type=int, default=128, help="per sampled turn")
    r.add_argument("--max-total-tokens", type=int, default=1536)
    r.add_argument("--temperature", type=float, default=1.0)
    r.add_argument("--request-timeout", type=float, default=300.0)
    r.set_defaults(func=cmd_rollout)

    t = sub.add_parser("train", help="GRPO training from a YAML config")
    _config_arguments(t, "YAML file (defaults for missing keys)", "algorithm.kl_beta=0.01")
    _run_arguments(t, "the run dir's last checkpoint")
    t.set_defaults(func=cmd_train)

    d = sub.add_parser("demos", help="write scripted-solver demonstrations (sft.demos) for a cold-start SFT")
    _config_arguments(d, "YAML file: rollout.env, rollout limits and sft.* are used", "sft.direct_share=0.5")
    d.add_argument("--out", help="output JSONL (default: sft.demos)")
    d.set_defaults(func=cmd_demos)

    s = sub.add_parser("sft", help="supervised fine-tuning of the adapter on demonstrations")
    _config_arguments(s, "YAML file: model, optim and sft.* are used", "sft.epochs=3")
    _run_arguments(s, "sft.run_dir's last checkpoint")
    s.set_defaults(func=cmd_sft)

    e = sub.add_parser("eval", help="accuracy, pass@k and tool use on held-out tasks; compare adapters")
    _config_arguments(e, "YAML file: model, sampler, rollout and eval.* are used", "eval.temperature=0.7")
    e.add_argument("--n", type=int, default=None, help="rollouts per task, K of pass@K (eval.samples)")
    e.add_argument("--tasks", type=int, default=None, help="held-out tasks (eval.tasks)")
    e.add_argument("--adapter", action="append",
                   help="'base', a peft adapter folder, or a run folder; twice to compare side by side")
    e.add_argument("--out", help="write the JSON report here")
    e.add_argument("--show", type=int, default=0, help="print the first rollout of this many tasks per adapter")
    e.set_defaults(func=cmd_eval)

    pa = sub.add_parser("play", help="play the policy's part of an environment yourself (stdin: scriptable)")
    pa.add_argument("env", help="built-in name or module path")
    pa.add_argument("--task", type=int, default=0, help="index of the task in the split")
    pa.add_argument("--split", default="train")
    pa.add_argument("--seed", type=int, default=0)
    pa.add_argument("--model", default="smollm2-135m", help="whose tokenizer and chat format to render with")
    pa.set_defaults(func=cmd_play)

    pl = sub.add_parser("plot", help="write PNG curves of a run")
    pl.add_argument("run_dir")
    pl.set_defaults(func=cmd_plot)

    sb = sub.add_parser("sandbox", help="sandboxed Python execution").add_subparsers(dest="action", required=True)
    ex = sb.add_parser("exec", help="run a Python file in the sandbox and print the result as JSON")
    ex.add_argument("file")
    ex.add_argument("--backend", choices=["auto", "bwrap", "docker", "subprocess"], default=None)
    ex.set_defaults(func=cmd_sandbox_exec)

    kg = sub.add_parser("kg", help="knowledge-graph API service").add_subparsers(dest="action", required=True)
    ks = kg.add_parser("serve", help="serve the country knowledge graph over HTTP")
    ks.add_argument("--host", default="127.0.0.1")
    ks.add_argument("--port", type=int, default=8090)
    ks.add_argument("--db", default=None, help="SQLite file (built on first use)")
    ks.set_defaults(func=cmd_kg_serve)

    se = sub.add_parser("search", help="full-text search over the country corpus").add_subparsers(dest="action", required=True)
    sq = se.add_parser("query", help="top-k titled snippets for a query")
    sq.add_argument("text", nargs="+")
    sq.add_argument("-k", type=int, default=5)
    sq.add_argument("--index", default=None, help="index file (built on first use)")
    sq.set_defaults(func=cmd_search_query)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except CLIError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
