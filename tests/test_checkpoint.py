"""Checkpoints: exact round trip, resume after a kill mid-save, keep-N pruning."""

from __future__ import annotations

import copy
import json
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

from agent_rl.learn.logprobs import token_logprobs
from agent_rl.learn.policy import apply_lora, load_causal_lm
from agent_rl.runs.checkpoint import (
    CheckpointError,
    checkpoints_dir,
    load_checkpoint,
    save_checkpoint,
)


def lora_setup(tiny_dir, seed: int = 0):
    torch.manual_seed(seed)
    model = apply_lora(load_causal_lm(str(tiny_dir)), rank=4)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 10))
    return model, opt, sched


def train_step(model, opt, sched) -> None:
    ids = torch.randint(0, 1000, (2, 12))  # drawn from the torch RNG: resumes must continue it
    loss = -token_logprobs(model, ids, torch.ones_like(ids)).logp_B_T.mean()
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_round_trip_restores_weights_optimizer_scheduler_and_rng(tiny_dir, tmp_path):
    model, opt, sched = lora_setup(tiny_dir)
    for _ in range(2):
        train_step(model, opt, sched)
    random.seed(1), np.random.seed(1)
    save_checkpoint(tmp_path, 2, model, opt, sched, data_position={"epoch": 0, "index": 16},
                    extra={"policy_version": 2})
    saved_weights, saved_opt = trainable(model), copy.deepcopy(opt.state_dict())
    expected_draws = draws()
    train_step(model, opt, sched)  # what the original run does next
    expected_next = trainable(model)

    model2, opt2, sched2 = lora_setup(tiny_dir, seed=123)  # fresh objects, other RNG state
    ckpt = load_checkpoint(tmp_path, model2, opt2, sched2)
    assert ckpt is not None and ckpt.step == 2
    assert ckpt.data_position == {"epoch": 0, "index": 16} and ckpt.extra == {"policy_version": 2}
    assert ckpt.path == checkpoints_dir(tmp_path) / "step-000002"
    restored = trainable(model2)
    assert restored.keys() == saved_weights.keys() and len(restored) > 0
    assert all(torch.equal(restored[n], saved_weights[n]) for n in restored)
    # Adam moments and step counts, bit for bit
    state2 = opt2.state_dict()
    assert len(state2["state"]) == len(saved_opt["state"]) > 0
    for k, s in saved_opt["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state2["state"][k][key], s[key]), (k, key)
    assert sched2.last_epoch == 2 and sched2.get_last_lr() == pytest.approx([1e-2 * 3 / 10])
    assert draws() == expected_draws  # Python, NumPy and torch RNGs continue identically
    train_step(model2, opt2, sched2)
    after = trainable(model2)
    assert all(torch.equal(after[n], expected_next[n]) for n in after)  # and so does training


def test_full_finetune_weights_round_trip_frozen_ones_are_not_stored(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[0].bias.requires_grad_(False)  # frozen: comes from the model folder, not the checkpoint
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path, 1, model, opt, None, data_position=3)

    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    other[0].bias.requires_grad_(False)
    frozen_before = other[0].bias.detach().clone()
    opt2 = torch.optim.SGD([p for p in other.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    ckpt = load_checkpoint(tmp_path, other, opt2)
    assert ckpt.data_position == 3
    for name in ("0.weight", "2.weight", "2.bias"):
        assert torch.equal(other.state_dict()[name], model.state_dict()[name])
    assert torch.equal(other[0].bias, frozen_before)
    assert torch.equal(opt2.state_dict()["state"][0]["momentum_buffer"],
                       opt.state_dict()["state"][0]["momentum_buffer"])


KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys, torch
    from torch import nn
    import agent_rl.runs.checkpoint as ck
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    ck.save_checkpoint(sys.argv[1], 1, model, None, None, data_position=1)
    with torch.no_grad():
        model.weight.add_(1.0)
    ck.save_checkpoint(sys.argv[1], 2, model, None, None, data_position=2)
    with torch.no_grad():
        model.weight.add_(1.0)
    real_save = torch.save
    def save_then_die(obj, f, *a, **k):  # the optimizer file is written, then the process is killed
        real_save(obj, f, *a, **k)
        os.kill(os.getpid(), signal.SIGKILL)
    torch.save = save_then_die
    ck.save_checkpoint(sys.argv[1], 3, model, None, None, data_position=3)
""")


def test_run_killed_mid_save_resumes_from_the_previous_complete_checkpoint(tmp_path):
    proc = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(tmp_path)], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-500:]
    root = checkpoints_dir(tmp_path)
    assert [p.name for p in root.glob(".tmp-step-000003-*")]  # the kill left a partial temp folder
    assert (root / "latest").read_text().strip() == "step-000002"

    model = nn.Linear(4, 4)
    ckpt = load_checkpoint(tmp_path, model, restore_rng=False)
    assert ckpt.step == 2 and ckpt.data_position == 2
    torch.manual_seed(0)
    expected = nn.Linear(4, 4).weight + 1.0
    assert torch.equal(model.weight, expected)

    # the next save removes the partial folder and succeeds
    save_checkpoint(tmp_path, 3, model, None, None, data_position=3)
    assert not list(root.glob(".tmp-*"))
    assert load_checkpoint(tmp_path, nn.Linear(4, 4), restore_rng=False).step == 3


def test_truncated_or_unfinished_checkpoint_is_never_loaded(tmp_path):
    model = nn.Linear(4, 4)
    save_checkpoint(tmp_path, 1, model, None, None, data_position=1)
    good = trainable(model)
    with torch.no_grad():
        model.weight.zero_()
    save_checkpoint(tmp_path, 2, model, None, None, data_position=2)
    root = checkpoints_dir(tmp_path)
    weights = root / "step-000002" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-7])  # truncated on disk; `latest` still names it
    # and a newer folder without a manifest (a copy interrupted by hand, say)
    (root / "step-000003").mkdir()
    (root / "step-000003" / "state.json").write_text(json.dumps({"step": 3}))

    restored = nn.Linear(4, 4)
    ckpt = load_checkpoint(tmp_path, restored, restore_rng=False)
    assert ckpt.step == 1
    assert all(torch.equal(restored.state_dict()[n], good[n]) for n in good)


def test_keep_n_pruning_and_an_abandoned_timeline(tmp_path):
    model = nn.Linear(2, 2)
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, model, None, None, data_position=step, keep=2)
    root = checkpoints_dir(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000004", "step-000005"]
    assert (root / "latest").read_text().strip() == "step-000005"
    # resumed from step 4 (say 5 was bad) and saved step 5 again: replaced in place
    save_checkpoint(tmp_path, 5, model, None, None, data_position="again", keep=2)
    assert load_checkpoint(tmp_path, restore_rng=False).data_position == "again"
    # saving an older step drops the newer ones: they belong to an abandoned timeline
    save_checkpoint(tmp_path, 3, model, None, None, data_position=3, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000003"]


def test_no_checkpoint_mismatch_and_bad_inputs(tmp_path):
    assert load_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, 1, nn.Linear(2, 2), None, None, data_position=0)
    with pytest.raises(CheckpointError, match="does not fit the model"):
        load_checkpoint(tmp_path, nn.Linear(2, 3, bias=False))
    with pytest.raises(CheckpointError, match=r"weight has shape \(2, 2\), the model \(3, 2\)"):
        load_checkpoint(tmp_path, nn.Linear(2, 3))
    with pytest.raises(TypeError, match="JSON serializable"):
        save_checkpoint(tmp_path, 2, nn.Linear(2, 2), None, None, data_position=object())
    assert sorted(p.name for p in checkpoints_dir(tmp_path).iterdir()) == ["latest", "step-000001"]
