"""Evaluation figures against hand counts, adapter resolution, side-by-side reports, and play."""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys

import pytest

from agent_rl.cli import main
from agent_rl.config.file import load_config
from agent_rl.core.registry import load_env
from agent_rl.evaluation.evaluate import (
    PolicySpec,
    eval_report,
    evaluate,
    pass_at_k,
    pass_figures,
    pass_hat_k,
    resolve_policy,
)
from agent_rl.play import play, read_reply, summary
from agent_rl.rollout.engine import rollout_groups
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.rollout.serving.base import Fleet
from agent_rl.session import open_session


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2) / C(4,2) draws miss the one
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0 and pass_at_k(5, 2, 3) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(2, 3, 1)


async def test_eval_figures_match_hand_counts(scripted, renderer):
    """4 tasks x 2 rollouts; the script solves task 0 both times with the tool, task 1 once directly
    (rollout 0) and once wrongly, tasks 2 and 3 never (one wrong tool call each, then a wrong answer)."""
    spec = load_env("calculator")
    tasks = spec.load_tasks(4, seed=5, split="eval")
    by_question = {t["question"]: (i, t) for i, t in enumerate(tasks)}
    counter: dict[int, int] = {}

    def script(text: str) -> str:
        i, task = next(v for q, v in by_question.items() if q in text)
        answer = f"The answer is {task['answer']}."
        if i == 0:  # the calculator, then its result
            if "<tool_response>" not in text:
                expression = task["expression"]
                return (f'<tool_call>\n{{"name": "calculator", "arguments": '
                        f'{{"expression": "{expression}"}}}}\n</tool_call>')
            return answer
        if i == 1:
            n = counter[i] = counter.get(i, 0) + 1
            return answer if n == 1 else "The answer is -1."
        if "<tool_response>" not in text:
            return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 +"}}\n</tool_call>'
        return "The answer is -1."

    groups = await rollout_groups(tasks, spec.make_env, scripted(script), renderer, EpisodeLimits(), 2,
                                  max_concurrent=1)
    r = eval_report(groups)
    assert {t.tools for g in groups for t in g.trajectories} == {("calculator",)}  # what the runner recorded
    assert r["tasks"] == 4 and r["rollouts"] == 8
    assert r["accuracy"] == 3 / 8 == r["pass@1"] == r["pass^1"]
    assert r["pass@2"] == (1 + 1 + 0 + 0) / 4
    assert r["pass^2"] == (1 + 0 + 0 + 0) / 4  # both rollouts right: task 0 only
    # "1 +" is a readable call the calculator fails: a tool error, no violation of the call format
    assert r["violation/malformed_call"] == 0.0 and r["violation/unknown_tool"] == 0.0
    assert r["tool_use_rate"] == 6 / 8  # task 0 twice, tasks 2 and 3 twice each
    assert r["accuracy_with_tools"] == 2 / 6 and r["accuracy_without_tools"] == 1 / 2
    assert r["tool/calculator/calls_per_traj"] == 6 / 8 and r["tool/calculator/failure_rate"] == 4 / 6
    assert r["turns_mean"] == (2 * 2 + 1 + 1 + 2 * 4) / 8 and r["infra_error_rate"] == 0.0
    assert r["tool_calls_per_solved"] == (1 + 1 + 0) / 3  # task 0 twice with one call, task 1 once with none


def test_pass_hat_k_by_hand():
    assert pass_hat_k(4, 1, 1) == 0.25 and pass_hat_k(4, 2, 2) == 1 / 6  # C(2,2) / C(4,2)
    assert pass_hat_k(5, 3, 2) == pytest.approx(3 / 10) and pass_hat_k(3, 3, 3) == 1.0 and pass_hat_k(3, 2, 3) == 0.0
    with pytest.raises(ValueError, match=r"pass\^k needs"):
        pass_hat_k(2, 1, 3)
    # (samples, correct) of three tasks: pass@2 and pass^2 over the tasks with at least 2 samples
    assert pass_figures([(2, 1), (2, 2), (1, 1)], [1, 2]) == {
        "pass@1": (0.5 + 1 + 1) / 3, "pass^1": (0.5 + 1 + 1) / 3, "pass@2": (1 + 1) / 2, "pass^2": (0 + 1) / 2}


def test_resolve_policy(tmp_path):
    assert resolve_policy("base") == PolicySpec("base", "base")
    run = tmp_path / "run"
    for v in (3, 10):
        (run / "adapters" / f"v{v}").mkdir(parents=True)
        (run / "adapters" / f"v{v}" / "adapter_config.json").write_text("{}")
    assert resolve_policy(str(run)) == PolicySpec(str(run), "adapter", run / "adapters" / "v10")
    (run / "adapter").mkdir()
    (run / "adapter" / "adapter_config.json").write_text("{}")
    assert resolve_policy(str(run)).path == run / "adapter"
    # a full fine-tune run keeps its newest weights under weights/v*; a model folder is full weights too
    full = tmp_path / "full"
    for v in (4, 6):
        (full / "weights" / f"v{v}").mkdir(parents=True)
        (full / "weights" / f"v{v}" / "config.json").write_text("{}")
    assert resolve_policy(str(full)) == PolicySpec(str(full), "weights", full / "weights" / "v6")
    assert resolve_policy(str(full / "weights" / "v4")).kind == "weights"
    with pytest.raises(ValueError, match="adapter '/nope': not a peft adapter folder"):
        resolve_policy("/nope")


def test_the_short_table_a_person_reads():
    from agent_rl.runs.summary import policy_table

    figures = lambda acc, p2, h2, tools: {"accuracy": acc, "pass@1": acc, "pass@2": p2, "pass^1": acc,  # noqa: E731
                                          "pass^2": h2, "tool_use_rate": tools, "tool/attempt_share": tools,
                                          "turns_mean": 2.0, "violation/any": 0.125, "reward_mean": 9.0}
    results = {"runs/sft": figures(0.25, 0.5, 0.0, 0.5), "runs/s0": figures(0.5, 0.75, 0.25, 0.75),
               "runs/s1": figures(0.75, 1.0, 0.5, 1.0)}
    lines = policy_table(results, baseline="runs/sft", names={"runs/sft": "sft"}, spread="seed spread").splitlines()
    assert [line.split() for line in lines] == [
        ["policy", "accuracy", "pass@2", "pass^2", "tool", "use", "attempts", "turns", "violations"],
        ["sft", "0.250", "0.500", "0.000", "0.500", "0.500", "2.000", "0.125"],
        ["runs/s0", "0.500", "0.750", "0.250", "0.750", "0.750", "2.000", "0.125"],
        ["runs/s1", "0.750", "1.000", "0.500", "1.000", "1.000", "2.000", "0.125"],
        ["gain", "runs/s0", "+0.250", "+0.250", "+0.250", "+0.250", "+0.250", "+0.000", "+0.000"],
        ["gain", "runs/s1", "+0.500", "+0.500", "+0.500", "+0.500", "+0.500", "+0.000", "+0.000"],
        ["seed", "spread", "0.250", "0.250", "0.250", "0.250", "0.250", "0.000", "0.000"]]
    # one policy: its row only; a figure it lacks is "-"
    assert policy_table({"base": {"accuracy": 0.5, "pass@1": 0.5}}).splitlines()[1].split() == \
        ["base", "0.500", "0.500", "-", "-", "-", "-", "-"]


def test_eval_cli_bad_adapter_is_one_line(capsys):
    assert main(["eval", "--adapter", "/no/adapter"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: adapter '/no/adapter': not a peft adapter folder (no adapter_config.json), a model "
                   "folder (config.json), nor a run folder with adapter/, adapters/v* or weights/v*; use 'base' "
                   "for the model without an adapter"]


@pytest.mark.integration
async def test_eval_against_vllm_fresh_adapter_equals_base(vllm_server, tiny_dir, tmp_path):
    """A fresh LoRA adapter (B = 0) is the base model: with the same tasks and per-request seeds,
    both evaluations must sample the very same tokens, so every figure's delta is exactly 0."""
    from agent_rl.learn.policy import apply_lora, load_causal_lm

    apply_lora(load_causal_lm(str(tiny_dir)), rank=8, alpha=16).save_pretrained(tmp_path / "fresh")
    cfg = load_config(None, [f"model.name={tiny_dir}", "rollout.env=toy", "rollout.max_turns=1",
                             "rollout.max_tokens_per_turn=24", "rollout.max_total_tokens=128",
                             "eval.tasks=3", "eval.samples=2"])
    groups: dict = {}
    served = contextlib.nullcontext(Fleet([vllm_server.url]))
    report = await evaluate(open_session(cfg), ["base", str(tmp_path / "fresh")], lambda _: served, groups)
    base, fresh = report["results"]["base"], report["results"][str(tmp_path / "fresh")]
    assert base["rollouts"] == 6 and base["infra_error_rate"] == 0.0
    assert [t.token_ids for g in groups["base"] for t in g.trajectories] == \
           [t.token_ids for g in groups[str(tmp_path / "fresh")] for t in g.trajectories]
    figures = {k: v for k, v in report["delta"].items() if not k.endswith("_s")}  # timings differ, of course
    undefined = {k for k in figures
                 if math.isnan(base[k]) and math.isnan(fresh[k])}  # e.g. calls per solved, none solved
    assert len(figures) - len(undefined) > 10 and {figures[k] for k in figures.keys() - undefined} == {0.0}
    assert fresh["reward_mean"] == base["reward_mean"]


def test_read_reply_shortcuts(renderer):
    stream = io.StringIO('/call calculator {"expression": "2 + 3"}\n.\nline one\nline two\n.\n/quit\n')
    assert read_reply(stream, renderer) == ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}'
                                            '\n</tool_call>')
    assert read_reply(stream, renderer) == "line one\nline two"
    with pytest.raises(Exception, match="the player quit"):
        read_reply(stream, renderer)
    with pytest.raises(ValueError, match="/call calculator: arguments are not JSON"):
        read_reply(io.StringIO("/call calculator {oops\n"), renderer)


async def test_play_from_a_script(renderer):
    spec = load_env("calculator")
    task = spec.load_tasks(1, seed=0)[0]
    script = io.StringIO(f'/call calculator {{"expression": "{task["expression"]}"}}\n.\n'
                         f"/call calculator {{broken\nThe answer is {task['answer']}.\n.\n")
    shown: list[str] = []
    traj = await play(spec, task, renderer, script, shown.append)
    assert traj.reward == 1.0 and [c.ok for c in traj.tool_calls] == [True]
    seen = "".join(shown)
    assert task["question"] in seen and f"<tool_response>\n{task['answer']}\n</tool_response>" in seen
    assert "error: /call calculator: arguments are not JSON" in seen  # a typo is reported, then re-read
    assert summary(traj)["stop_reason"] == "no_tool_call"


def test_play_cli_driven_by_stdin():
    from agent_rl.envs.calculator import load_tasks

    task = load_tasks(2, seed=0)[1]
    proc = subprocess.run([sys.executable, "-m", "agent_rl.cli", "play", "calculator", "--task", "1"],
                          input=f"The answer is {task['answer']}.\n", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["reward"] == 1.0 and out["tool_calls"] == [] and out["task_id"] == task["id"]
    assert task["question"] in proc.stdout


@pytest.mark.integration
async def test_eval_of_full_weights_serves_them(vllm_server, tiny_dir, tmp_path):
    """A full fine-tune's weights (saved without a tokenizer, as FullWeightSync saves them) are served by a
    server started on them: the same weights as the base model sample the very same tokens."""
    from agent_rl.learn.policy import load_causal_lm
    from agent_rl.rollout.serving.choose import serving_backend

    load_causal_lm(str(tiny_dir)).save_pretrained(tmp_path / "full" / "weights" / "v2")
    cfg = load_config(None, [f"model.name={tiny_dir}", "rollout.env=toy", "rollout.max_turns=1",
                             "rollout.max_tokens_per_turn=24", "rollout.max_total_tokens=128",
                             "eval.tasks=3", "eval.samples=2", "sampler.kv_cache_gib=1", "sampler.max_model_len=512"])
    session, started = open_session(cfg), []

    def serve(model_dir):
        if model_dir == session.model_dir:
            return contextlib.nullcontext(Fleet([vllm_server.url]))  # the base model: the session's server
        started.append(model_dir)
        return serving_backend().serve(cfg.model, cfg.sampler, cfg.run.seed, model_dir, tokenizer=session.model_dir)

    groups: dict = {}
    report = await evaluate(session, ["base", str(tmp_path / "full")], serve, groups)
    assert started == [tmp_path / "full" / "weights" / "v2"]
    assert [t.token_ids for g in groups["base"] for t in g.trajectories] == \
           [t.token_ids for g in groups[str(tmp_path / "full")] for t in g.trajectories]
    assert report["results"]["base"]["rollouts"] == 6
    with pytest.raises(ValueError, match="sampler.server_urls: full weights are evaluated on a server started"):
        attached = load_config(None, [f"model.name={tiny_dir}", f"sampler.server_urls=[{vllm_server.url}]"])
        await evaluate(open_session(attached), [str(tmp_path / "full")], serve)
