"""The `agent-rl` command line: argument parsing and the rule that every failure is one line.

Owns: the sub-commands' arguments (`build_parser`) and `main`, which prints a `CLIError` as
`error: ...` and exits non-zero (2 for bad input, 1 for a failed run); `raise_on_sigterm` (a SIGTERM
unwinds the command like Ctrl-C, so that the vLLM servers and sandboxes it started are stopped; `main` does
the same for SIGUSR1; `train`'s loop preempts the run instead, `agent_rl.stopping`).
Does not own: what the commands do (`commands`), or any logic beyond wiring.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

from agent_rl import commands
from agent_rl.commands import CLIError


def _config_arguments(p: argparse.ArgumentParser, uses: str, example: str) -> None:
    """The CONFIG file and its --set overrides, read by `commands.config`."""
    p.add_argument("config", nargs="?", help=uses)
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help=f"override, e.g. {example}")


def _run_arguments(p: argparse.ArgumentParser, checkpoints: str) -> None:
    """What a training command (train, sft) offers beyond its config."""
    p.add_argument("--resume", action="store_true", help=f"continue from {checkpoints}")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip writing PNG curves at the end")


def _play_parsers(sub) -> None:
    """Commands that play episodes: rollout (a model), play (a person), audit-reward (scripted hacks)."""
    r = sub.add_parser("rollout", help="play an environment with a model and print the trajectories")
    r.add_argument("--env", default="calculator",
                   help="built-in name, module name (the current folder included) or .py file")
    r.add_argument("--env-args", default="{}", metavar="MAPPING",
                   help="keyword arguments of the environment's load_tasks (rollout.env_args), e.g. '{taskset: name}'")
    r.add_argument("--model", default="smollm2-135m",
                   help="folder, hub id, .gguf file, or a built-in: smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b")
    r.add_argument("--renderer", default="auto", help="chat format: auto (from the tokenizer) or a family name")
    r.add_argument("--bare-calls", choices=("auto", "on", "off"), default="auto",
                   help="read replies of bare JSON calls (no <tool_call> tags) as calls; auto: the renderer's default")
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
    r.add_argument("--workers", type=int, default=0,
                   help="play the episodes on this many Ray workers (rollout.workers; a local cluster, or RAY_ADDRESS)")
    r.set_defaults(func=commands.rollout)

    pa = sub.add_parser("play", help="play the policy's part of an environment yourself (stdin: scriptable)")
    pa.add_argument("env", help="built-in name, module name (the current folder included) or .py file")
    pa.add_argument("--task", type=int, default=0, help="index of the task in the split")
    pa.add_argument("--split", default="train")
    pa.add_argument("--seed", type=int, default=0)
    pa.add_argument("--model", default="smollm2-135m", help="whose tokenizer and chat format to render with")
    pa.set_defaults(func=commands.play)

    au = sub.add_parser("audit-reward", help="play known reward hacks through environments; fail if any earns reward")
    au.add_argument("env", nargs="+", help="built-in name(s) or module path(s)")
    au.add_argument("--tasks", type=int, default=3, help="tasks each hack variant and the solver play")
    au.add_argument("--split", default="train")
    au.add_argument("--seed", type=int, default=0)
    au.add_argument("--model", default="smollm2-135m", help="whose tokenizer and chat format to render with")
    au.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="keyword argument of each environment's load_tasks (a YAML value), as rollout.env_args: "
                         "e.g. turn_rewards=true audits the turn rewards too")
    au.add_argument("--relative", nargs="?", const="", metavar="CONFIG",
                    help="also play each hack in a group of honest rollouts and fail it when its advantage is above an "
                         "honest failure's, under CONFIG's algorithm section (credit, advantage, gamma, step_weight, "
                         "truncated_reward; no CONFIG: the defaults)")
    au.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override of the --relative config, e.g. algorithm.credit=gigpo")
    au.add_argument("--json", dest="json_out", help="also write the reports (with a sample episode per failure) here")
    au.set_defaults(func=commands.audit_reward)


def _training_parsers(sub) -> None:
    """Commands that read a config or a run: train, demos, bootstrap, sft, eval, plot, view."""
    t = sub.add_parser("train", help="GRPO training from a YAML config")
    _config_arguments(t, "YAML file (defaults for missing keys)", "algorithm.kl_beta=0.01")
    _run_arguments(t, "the run dir's last checkpoint")
    t.add_argument("--nproc", type=int, default=1, help="trainer ranks on this machine (runs under torchrun)")
    t.add_argument("--nnodes", type=int, default=1, help="machines, each running this command (torchrun)")
    t.add_argument("--node-rank", type=int, default=0, help="this machine's rank among --nnodes")
    t.add_argument("--rdzv-endpoint", help="HOST:PORT every machine of a multi-node run meets at")
    t.set_defaults(func=commands.train)

    d = sub.add_parser("demos", help="write scripted-solver demonstrations (sft.demos) for a cold-start SFT")
    _config_arguments(d, "YAML file: rollout.env, rollout limits and sft.* are used", "sft.direct_share=0.5")
    d.add_argument("--out", help="output JSONL (default: sft.demos)")
    d.set_defaults(func=commands.demos)

    b = sub.add_parser("bootstrap", help="demonstrations (sft.demos) from the policy's own tool-using, solved "
                                         "episodes, played with help and kept without it")
    _config_arguments(b, "YAML file: model, sampler, rollout, eval.success_threshold and sft.* are used",
                      "sft.num_demos=64")
    b.add_argument("--hint", help="a hint (a text file, added to the system prompt) or a worked example (a .json list "
                                  "of {role, content} messages, placed before the task)")
    b.add_argument("--force-call", action="store_true", help="open a call at the start of each episode's first turn")
    b.add_argument("--tasks", type=int, default=None, help="training tasks played (default: sft.num_demos)")
    b.add_argument("--samples", type=int, default=4, help="episodes per task")
    b.add_argument("--out", help="output JSONL (default: sft.demos)")
    b.set_defaults(func=commands.bootstrap)

    s = sub.add_parser("sft", help="supervised fine-tuning of the adapter on demonstrations")
    _config_arguments(s, "YAML file: model, optim and sft.* are used", "sft.epochs=3")
    _run_arguments(s, "sft.run_dir's last checkpoint")
    s.set_defaults(func=commands.sft)

    e = sub.add_parser("eval", help="accuracy, pass@k and tool use on held-out tasks; compare adapters")
    _config_arguments(e, "YAML file: model, sampler, rollout and eval.* are used", "eval.temperature=0.7")
    e.add_argument("--n", type=int, default=None, help="rollouts per task, K of pass@K and pass^K (eval.samples; "
                                                       "bfcl: episodes of each question, default 1)")
    e.add_argument("--tasks", type=int, default=None, help="held-out tasks (eval.tasks)")
    e.add_argument("--adapter", action="append",
                   help="'base', a peft adapter folder, or a run folder; twice to compare side by side")
    e.add_argument("--out", help="the JSON report (default: runs/eval/<kind>-<time>.json); the replies go beside it, "
                                 "X.replies.jsonl (agent-rl view X.replies.jsonl)")
    e.add_argument("--show", type=int, default=0, help="print the first rollout of this many tasks per adapter")
    e.add_argument("--benchmark", choices=["bfcl"],
                   help="a benchmark instead of the config's environment: bfcl (needs `make bfcl-setup`)")
    e.add_argument("--categories", help="bfcl: comma-separated categories (default: simple, multiple, parallel, "
                                        "parallel_multiple, irrelevance; multi_turn: the four multi-turn ones)")
    e.add_argument("--per-category", type=int, default=None, help="bfcl: questions of each category (default 20)")
    e.set_defaults(func=commands.evaluate)

    pl = sub.add_parser("plot", help="write PNG curves of a run")
    pl.add_argument("run_dir")
    pl.set_defaults(func=commands.plot)

    v = sub.add_parser("view", help="write an HTML page to browse a run's rollout traces (run.trace_groups), or an "
                                    "evaluation's replies (X.replies.jsonl, beside its report)")
    v.add_argument("run_dir", help="a run directory, or an evaluation's X.replies.jsonl")
    v.add_argument("--out", help="the page (default: RUN_DIR/traces.html, or X.replies.html)")
    v.add_argument("--steps", help="only these steps (of replies: policies, 1 the first), e.g. 1-5,10 (default: all)")
    v.set_defaults(func=commands.view)


def _tool_parsers(sub) -> None:
    """The tools' own services: sandbox, knowledge graph, search."""
    sb = sub.add_parser("sandbox", help="sandboxed Python execution").add_subparsers(dest="action", required=True)
    ex = sb.add_parser("exec", help="run a Python file in the sandbox and print the result as JSON")
    ex.add_argument("file")
    ex.add_argument("--backend", choices=["auto", "bwrap", "docker", "subprocess"], default=None)
    ex.set_defaults(func=commands.sandbox_exec)

    kg = sub.add_parser("kg", help="knowledge-graph API service").add_subparsers(dest="action", required=True)
    ks = kg.add_parser("serve", help="serve the country knowledge graph over HTTP")
    ks.add_argument("--host", default="127.0.0.1")
    ks.add_argument("--port", type=int, default=8090)
    ks.add_argument("--db", default=None, help="SQLite file (built on first use)")
    ks.set_defaults(func=commands.kg_serve)

    se = sub.add_parser("search", help="full-text search over the country corpus")
    se = se.add_subparsers(dest="action", required=True)
    sq = se.add_parser("query", help="top-k titled snippets for a query")
    sq.add_argument("text", nargs="+")
    sq.add_argument("-k", type=int, default=5)
    sq.add_argument("--index", default=None, help="index file (built on first use)")
    sq.set_defaults(func=commands.search_query)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agent-rl", description="Multi-turn tool-use GRPO for LLM agents.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    _play_parsers(sub)
    _training_parsers(sub)
    _tool_parsers(sub)
    return p


class Terminated(KeyboardInterrupt):
    """A SIGTERM (or SIGUSR1), raised where the main thread is, as Ctrl-C's KeyboardInterrupt would be."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__()
        self.signum = signum


def _terminate(signum: int, frame: object) -> None:
    raise Terminated(signum)


def raise_on_sigterm() -> Any:
    """Turn SIGTERM (`kill`, `timeout`, a job scheduler) into `Terminated`, so that every `with` and
    `async with` block unwinds: the servers a run started live in their own session (Ctrl-C at a
    terminal does not reach them) and would otherwise outlive it, holding their memory or GPU.
    Only in the main thread, where Python runs signal handlers; returns the handler it replaced
    (None elsewhere), for `signal.signal` to put back."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _terminate)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    previous = raise_on_sigterm()
    # SLURM's warning signal: by default it would end the process and leave the servers it started running
    usr1 = signal.signal(signal.SIGUSR1, _terminate) if previous is not None else None
    try:
        return int(args.func(args) or 0)
    except CLIError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except Terminated as e:
        print(f"error: terminated ({signal.Signals(e.signum).name})", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGUSR1, usr1)


if __name__ == "__main__":
    sys.exit(main())
