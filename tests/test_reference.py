"""The KL reference is the policy a run started from: a saved starting adapter, or a frozen copy of
every weight under full fine-tuning, never the base model behind a trained adapter."""

from __future__ import annotations

import torch
from helpers import make_batch, tiny_config

from agent_rl.learn.logprobs import Scoring, token_logprobs
from agent_rl.learn.policy import (
    apply_lora,
    build_policy,
    load_causal_lm,
    trainable_parameters,
)
from agent_rl.learn.reference import FrozenCopy, SavedAdapter
from agent_rl.learn.update import policy_update


def saved_adapter(tiny_dir, path):
    """A LoRA adapter that is not the base model (B != 0), as a cold-start SFT leaves one."""
    torch.manual_seed(1)
    model = apply_lora(load_causal_lm(str(tiny_dir)), rank=8, alpha=16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.save_pretrained(path)
    return path


def logprobs(model, batch):
    """The model's log-probs of the batch's sampled tokens (every other column 0.0, as a reference gives them)."""
    with torch.no_grad():
        logp = token_logprobs(model, batch.input_ids_B_T, batch.attention_mask_B_T).logp_B_T
    return torch.where(batch.loss_mask_B_T, logp, 0.0)


def test_a_run_from_a_saved_adapter_keeps_that_adapter_as_its_reference(tiny_dir, tmp_path):
    start = saved_adapter(tiny_dir, tmp_path / "sft")
    cfg = tiny_config(tiny_dir, **{"model.init_adapter": str(start), "algorithm.kl_beta": 0.1,
                              "algorithm.mini_batches": 2})
    policy = build_policy(cfg.model, cfg.optim, tiny_dir, with_reference=True)
    assert isinstance(policy.reference, SavedAdapter)
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    batch = make_batch(policy)
    before = logprobs(policy.model, batch)
    ref = policy.reference.logprobs(batch, Scoring())
    torch.testing.assert_close(ref, before, rtol=0, atol=1e-6)  # the starting policy, not the base model
    with policy.model.disable_adapter():
        base = logprobs(policy.model, batch)
    assert (base - before).abs().max() > 1e-3
    # the reference pass switches adapters: the trained one must stay the only trainable one
    assert [n for n, p in policy.model.named_parameters() if p.requires_grad] == trainable
    assert all("reference" not in n for n in trainable)

    stats = policy_update(policy, batch, cfg.algorithm, cfg.optim, 1.0)
    assert stats["kl"] > 0.0  # the second step is away from the start
    assert [n for n, p in policy.model.named_parameters() if p.requires_grad] == trainable
    after = logprobs(policy.model, batch)
    again = policy.reference.logprobs(batch, Scoring())
    assert (after - before).abs().max() > 1e-3  # the policy moved...
    torch.testing.assert_close(again, before, rtol=0, atol=1e-6)  # ...its reference did not


def test_the_first_step_from_a_saved_adapter_has_no_kl(tiny_dir, tmp_path):
    """Before this was fixed the reference was the base model: KL > 0 from the first token."""
    start = saved_adapter(tiny_dir, tmp_path / "sft")
    cfg = tiny_config(tiny_dir, **{"model.init_adapter": str(start), "algorithm.kl_beta": 0.1})
    policy = build_policy(cfg.model, cfg.optim, tiny_dir, with_reference=True)
    assert policy_update(policy, make_batch(policy), cfg.algorithm, cfg.optim, 1.0)["kl"] == 0.0


def test_full_fine_tuning_with_a_kl_term_keeps_a_frozen_copy(tiny_dir):
    cfg = tiny_config(tiny_dir, **{"model.full_finetune": "true", "algorithm.kl_beta": 0.1,
                              "algorithm.mini_batches": 2, "optim.lr": 1e-3})
    policy = build_policy(cfg.model, cfg.optim, tiny_dir, with_reference=True)
    assert isinstance(policy.reference, FrozenCopy)
    assert not any(p.requires_grad for p in policy.reference.model.parameters())
    assert len(trainable_parameters(policy.model)) == len(list(policy.model.parameters()))
    batch = make_batch(policy)
    before = logprobs(policy.model, batch)
    stats = policy_update(policy, batch, cfg.algorithm, cfg.optim, 1.0)
    assert stats["kl"] > 0.0 and stats["optimizer_steps"] == 2.0
    ref = policy.reference.logprobs(batch, Scoring())
    torch.testing.assert_close(ref, before, rtol=0, atol=1e-6)
    assert (logprobs(policy.model, batch) - before).abs().max() > 1e-3
