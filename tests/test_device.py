"""Device and precision chosen once: a bfloat16 policy computes in bfloat16 and takes its log-probs and
loss in float32, every tensor on its device; gradient checkpointing changes memory, not gradients."""

from __future__ import annotations

import pytest
import torch
from helpers import make_batch, tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

from agent_rl.learn.device import resolve_device, resolve_dtype
from agent_rl.learn.logprobs import token_logprobs
from agent_rl.learn.policy import build_policy, trainable_parameters
from agent_rl.learn.update import policy_update


class Placement(TorchDispatchMode):
    """Every tensor an op creates: its op, dtype and device."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, torch.dtype, torch.device]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.seen.append((str(func), t.dtype, t.device))
        return out


def test_auto_is_cuda_in_bfloat16_where_there_is_one_and_cpu_in_float32_here():
    device = resolve_device("auto")
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="model.device: cuda requested, but torch sees no CUDA device"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="model.device: not a device: 'gpu0'"):
        resolve_device("gpu0")


def test_a_bfloat16_update_keeps_every_tensor_on_the_models_device_and_dtype(tiny_dir):
    cfg = tiny_config(tiny_dir, **{"model.dtype": "bfloat16", "algorithm.mini_batches": 2, "algorithm.kl_beta": 0.1})
    policy = build_policy(cfg.model, cfg.optim, tiny_dir, with_reference=True)
    base = {p.dtype for n, p in policy.model.named_parameters() if "lora_" not in n}
    assert base == {torch.bfloat16}  # the adapter's own weights stay float32 (peft), the model is bf16
    batch = make_batch(policy)
    with Placement() as placement:
        stats = policy_update(policy, batch, cfg.algorithm, cfg.optim, 1.0)
    assert stats["grad_norm"] > 0
    dtypes = {dtype for _, dtype, _ in placement.seen}
    devices = {device for _, _, device in placement.seen}
    assert devices == {policy.device}
    assert dtypes <= {torch.bfloat16, torch.float32}, [s for s in placement.seen if s[1] not in (torch.bfloat16,
                                                                                                  torch.float32)]
    # the transformer body really ran in bf16, and the log-softmax in float32
    assert any("mm" in op and dtype == torch.bfloat16 for op, dtype, _ in placement.seen)
    assert any("log_softmax" in op and dtype == torch.float32 for op, dtype, _ in placement.seen)
    with torch.no_grad():
        out = token_logprobs(policy.model, batch.input_ids_B_T, batch.attention_mask_B_T)
    assert out.logp_B_T.dtype == torch.float32 and out.entropy_B_T.dtype == torch.float32


def gradients(tiny_dir, checkpointing: bool, full: bool = False):
    sets = {"model.gradient_checkpointing": str(checkpointing).lower(), "model.full_finetune": str(full).lower()}
    cfg = tiny_config(tiny_dir, **sets)
    torch.manual_seed(0)
    policy = build_policy(cfg.model, cfg.optim, tiny_dir)
    assert policy.model.is_gradient_checkpointing == checkpointing
    batch = make_batch(policy)
    policy.model.train()
    logp = token_logprobs(policy.model, batch.input_ids_B_T, batch.attention_mask_B_T).logp_B_T
    (-(torch.where(batch.loss_mask_B_T, logp, 0.0).sum() / batch.step_num_tokens)).backward()
    return torch.cat([p.grad.flatten() for p in trainable_parameters(policy.model)])


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
def test_gradient_checkpointing_gives_the_same_gradients(tiny_dir, full):
    on, off = gradients(tiny_dir, True, full), gradients(tiny_dir, False, full)
    assert off.abs().max() > 1e-4
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-7)


def test_checkpointing_is_on_by_default_for_lora_only(tiny_dir):
    lora = tiny_config(tiny_dir)
    full = tiny_config(tiny_dir, **{"model.full_finetune": "true"})
    assert build_policy(lora.model, lora.optim, tiny_dir).model.is_gradient_checkpointing
    assert not build_policy(full.model, full.optim, tiny_dir).model.is_gradient_checkpointing
