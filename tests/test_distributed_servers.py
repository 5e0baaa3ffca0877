"""`agent-rl train --nproc 2` (two gloo ranks standing in for two GPUs) against the session's vLLM servers: every
push reaches the servers and serves the trainer's log-probs, and a killed or resumed run ends as the straight one.
The update's equality with one process: tests/test_distributed.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def agent_rl_train(run_dir: Path, urls: list[str], model_dir, steps: int, *extra: str,
                   sets: dict | None = None) -> subprocess.Popen:
    sets = {"model.name": model_dir, "model.lora_rank": 8, "model.lora_alpha": 16, "model.sync": "adapter",
            "sampler.server_urls": f"[{','.join(urls)}]", "sampler.max_model_len": 2048, "rollout.env": "toy",
            "rollout.tasks_per_step": 2, "rollout.group_size": 4, "rollout.max_turns": 1,
            "rollout.max_tokens_per_turn": 32, "rollout.max_total_tokens": 128, "optim.lr": "3e-3",
            "run.steps": steps, "run.run_dir": run_dir, "run.seed": 7, "run.tensorboard": "false", **(sets or {})}
    cmd = [str(Path(sys.executable).with_name("agent-rl")), "train", "--nproc", "2", "--no-plot",
           *[f"--set={k}={v}" for k, v in sets.items()], *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen, timeout_s: float = 900) -> str:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err[-3000:]
    return out


@pytest.mark.integration
@pytest.mark.timeout(1800)  # three 2-rank runs, and maybe the start of the second session server
def test_two_ranks_two_servers_train_resume_and_match(tmp_path, vllm_server, dev_server, tiny_dir, renderer):
    """`agent-rl train --nproc 2` against two vLLM servers: every step's adapter reaches both and serves the
    trainer's log-probs; killed after its checkpoint of step 2 and resumed, it ends with the same adapter as
    the run that was never stopped."""
    import json
    import signal
    import time

    from helpers import LOGPROB_TOL, served_name_of, server_logprobs
    from peft import PeftModel
    from safetensors.torch import load_file

    from agent_rl.learn.logprobs import token_logprobs
    from agent_rl.learn.policy import load_causal_lm

    urls = [vllm_server.url, dev_server.url]
    straight = tmp_path / "straight"
    finish(agent_rl_train(straight, urls, tiny_dir, 3))
    final = json.loads((straight / "metrics.jsonl").read_text().splitlines()[-1])  # the last step's, as printed
    assert final["train_tokens"] > 0
    adapter = straight / "adapters" / "v3"
    model = PeftModel.from_pretrained(load_causal_lm(str(tiny_dir)), str(adapter)).eval()
    ids = renderer.render([]) + renderer.encode("A fixed sequence to score, the same everywhere.")
    with torch.no_grad():
        ours = token_logprobs(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)).logp_B_T[0, :-1]
    for url in urls:  # both servers hold the last version
        theirs = server_logprobs(url, served_name_of(url, adapter), ids)
        assert (ours - theirs).abs().max().item() < LOGPROB_TOL

    killed = tmp_path / "killed"
    proc = agent_rl_train(killed, urls, tiny_dir, 3)
    latest, deadline = killed / "checkpoints" / "latest", time.monotonic() + 900
    while not (latest.is_file() and latest.read_text().strip() >= "step-000002"):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its step-2 checkpoint"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks, mid-run
    proc.wait(timeout=60)
    finish(agent_rl_train(killed, urls, tiny_dir, 3, "--resume"))

    a = load_file(str(straight / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(killed / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    rewards = [[json.loads(x)["reward_mean"] for x in (d / "metrics.jsonl").read_text().splitlines()]
               for d in (straight, killed)]
    assert rewards[0] == rewards[1] and len(rewards[0]) == 3


@pytest.mark.integration
@pytest.mark.timeout(1200)  # two 2-rank runs (3 steps in all), and maybe the start of the dev-mode server
def test_two_ranks_full_finetune_push_checkpoint_and_resume(tmp_path, dev_server, tiny_dir, renderer):
    """`agent-rl train --nproc 2` fully fine-tuning against a dev-mode server: each push gathers the sharded
    weights on rank 0 and the server then serves exactly the trainer's log-probs (those of the step-2
    checkpoint, gathered apart); a second run resumed from the step-1 checkpoint ends equal to the first."""
    import json
    import shutil

    from helpers import LOGPROB_TOL, server_logprobs

    from agent_rl.learn.logprobs import token_logprobs
    from agent_rl.learn.policy import enable_full_finetune, load_causal_lm
    from agent_rl.runs.checkpoint import load_checkpoint

    full = {"model.full_finetune": "true", "model.sync": "auto", "optim.lr": "1e-4", "run.save_every": 1}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    finish(agent_rl_train(straight, [dev_server.url], tiny_dir, 2, sets=full))
    final = json.loads((straight / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["train_tokens"] > 0
    model = enable_full_finetune(load_causal_lm(str(tiny_dir)))
    assert load_checkpoint(straight, model, restore_rng=False).step == 2
    ids = renderer.render([]) + renderer.encode("A fixed sequence to score, the same everywhere.")
    with torch.no_grad():
        ours = token_logprobs(model.eval(), torch.tensor([ids]),
                              torch.ones(1, len(ids), dtype=torch.long)).logp_B_T[0, :-1]
    start = token_logprobs(load_causal_lm(str(tiny_dir)), torch.tensor([ids]),
                           torch.ones(1, len(ids), dtype=torch.long))
    assert (ours - start.logp_B_T[0, :-1]).abs().max().item() > 10 * LOGPROB_TOL  # two steps moved the policy
    assert (ours - server_logprobs(dev_server.url, "base", ids)).abs().max().item() < LOGPROB_TOL

    # as if killed after step 1: the second run finds only the step-1 checkpoint
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step-000001", resumed / "checkpoints" / "step-000001")
    (resumed / "checkpoints" / "latest").write_text("step-000001\n")
    finish(agent_rl_train(resumed, [dev_server.url], tiny_dir, 2, "--resume", sets=full))
    a, b = (load_checkpoint(d, restore_rng=False).path / "weights.safetensors" for d in (straight, resumed))
    assert b.parent.name == "step-000002"
    from safetensors.torch import load_file

    wa, wb = load_file(str(a)), load_file(str(b))
    assert wa.keys() == wb.keys() and max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5
    rewards = [[json.loads(x)["reward_mean"] for x in (d / "metrics.jsonl").read_text().splitlines()]
               for d in (straight, resumed)]
    assert rewards[1] == rewards[0][1:] and len(rewards[0]) == 2
