"""The tool-use cold start and branching on a real vLLM server (the session's tiny model): `agent-rl bootstrap
--force-call` plays, keeps and reports its yield; then two GRPO steps with `algorithm.tool_branches` on, whose
groups (the random tiny model never calls the calculator) branch at the tool decision, the forced opening given
and the rest sampled by the server, and train."""

from __future__ import annotations

import asyncio
import json

import pytest

from agent_rl import trainer
from agent_rl.cli import main
from agent_rl.config.file import load_config
from agent_rl.core.types import Branch

pytestmark = pytest.mark.integration


def sets(vllm_server, run_dir, **extra: str) -> list[str]:
    base = {"model.name": str(vllm_server.model_dir), "model.lora_rank": "8", "model.lora_alpha": "16",
            "sampler.server_urls": f"[{vllm_server.url}]", "sampler.max_model_len": "2048",
            "rollout.env": "calculator", "rollout.tasks_per_step": "2", "rollout.group_size": "4",
            "rollout.max_turns": "2", "rollout.max_tokens_per_turn": "24", "rollout.max_total_tokens": "1024",
            "optim.lr": "3e-3", "run.steps": "2", "run.run_dir": str(run_dir), "run.seed": "7",
            "run.tensorboard": "false", "run.trace_groups": "2", **extra}
    return [f"{k}={v}" for k, v in base.items()]


def test_bootstrap_reports_its_yield_on_a_real_server(tmp_path, vllm_server, capsys):
    """A random model seldom finishes a forced call well and solves its task: the command ends either with the
    demonstrations' file and its counts, or with one line saying that nothing was kept and why."""
    out = tmp_path / "demos.jsonl"
    argv = ["bootstrap", "--force-call", "--tasks", "2", "--samples", "2", "--out", str(out)]
    for s in sets(vllm_server, tmp_path / "run"):
        argv += ["--set", s]
    code = main(argv)
    captured = capsys.readouterr()
    if code == 0:
        line = json.loads(captured.out.strip().splitlines()[-1])
        assert line["played"] == 4.0 and line["kept"] >= 1 and out.is_file()
        assert not (tmp_path / "demos.jsonl.parts").exists()  # the parts a killed bootstrap would go on from: gone
    else:
        assert code == 1 and "error: no episode of 4 used a tool and solved its task" in captured.err
        assert "(failed 0.00, attempted " in captured.err  # a policy that does not succeed, not a broken run
        parts = [json.loads(x) for x in (tmp_path / "demos.jsonl.parts").read_text().splitlines()]
        assert sum(part["counts"]["played"] for part in parts) == 4.0  # what was played is kept


def test_two_grpo_steps_with_branches_at_the_tool_decision(tmp_path, vllm_server, renderer):
    run_dir = tmp_path / "run"
    cfg = load_config(None, sets(vllm_server, run_dir, **{"algorithm.tool_branches": "0.5"}))
    seen = []
    advantages = trainer.Stages().advantages

    def noted(groups, *args):
        seen.append(groups)
        return advantages(groups, *args)

    asyncio.run(trainer.train(cfg, stages=trainer.Stages(advantages=noted)))
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all("tool/attempt_share" in x for x in lines)
    opening = tuple(renderer.call_opening())
    branched = [t for groups in seen for g in groups for t in g.trajectories if t.branch is not None]
    # every group without a call attempt branched: 2 branches of each (0.5 x 4)
    no_try = sum(1 for groups in seen for g in groups
                 if not any(t.used_tools for t in g.trajectories if t.branch is None))
    logged = sum(x.get("branch/episodes", 0.0) for x in lines)
    assert no_try > 0 and len(branched) == 2 * no_try and logged == len(branched)
    for t in branched:
        assert isinstance(t.branch, Branch) and t.branch.forced == opening
        turn = t.turns[t.branch.turn]
        seg = t.all_segments[turn.segment]
        head = len(t.branch.head)
        assert seg.token_ids[turn.start:turn.start + head] == t.branch.head
        assert seg.loss_mask[turn.start:turn.start + head] == (0,) * head  # given: out of the loss
        assert all(seg.loss_mask[turn.start + head:turn.end])  # the server's own tokens: trained
    assert (run_dir / "adapter" / "adapter_config.json").is_file()
