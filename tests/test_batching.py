"""Collation and micro-batching, checked against tensors written out by hand."""

import pytest
import torch
from helpers import trajectory

from agent_rl.learn.batching import collate, micro_batches

# A: prompt 10 11 | sampled 12 13 | tool output 14 | sampled 15   (two turns)
A = trajectory(task_id="A", ids=[10, 11, 12, 13, 14, 15], mask=[0, 0, 1, 1, 0, 1], logprobs=[0, 0, -0.1, -0.2, 0, -0.3])
# B: prompt 20 | sampled 21 22
B = trajectory(task_id="B", ids=[20, 21, 22], mask=[0, 1, 1], logprobs=[0, -0.5, -0.6])
# C: prompt 30 | sampled 31
C = trajectory(task_id="C", ids=[30, 31], mask=[0, 1], logprobs=[0, -0.7])


def test_collate_by_hand():
    batch = collate([A, B], [0.5, -1.0], pad_token_id=0)
    # column t describes token t+1: A's sampled tokens sit at indices 2, 3, 5 -> columns 1, 2, 4
    assert batch.input_ids_B_T.tolist() == [[10, 11, 12, 13, 14, 15], [20, 21, 22, 0, 0, 0]]
    assert batch.attention_mask_B_T.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]
    assert batch.loss_mask_B_T.tolist() == [
        [False, True, True, False, True, False],
        [True, True, False, False, False, False],
    ]
    torch.testing.assert_close(
        batch.sampler_logp_B_T,
        torch.tensor([[0, -0.1, -0.2, 0, -0.3, 0], [-0.5, -0.6, 0, 0, 0, 0]]),
        atol=0,
        rtol=0,
    )
    assert batch.advantage_B.tolist() == [0.5, -1.0]
    assert batch.loss_mask_B_T.dtype == torch.bool
    assert batch.sampler_logp_B_T.dtype == torch.float32
    # 3 + 2 sampled tokens, 2 sequences
    assert (batch.step_num_tokens, batch.step_num_sequences) == (5, 2)
    assert batch.input_ids_B_T.shape[0] == 2


def test_collate_enforces_zero_logprob_off_the_mask():
    odd = trajectory(task_id="odd", ids=[1, 2, 3], mask=[0, 0, 1], logprobs=[0, 9.0, -0.4])  # 9.0 on a tool token
    assert collate([odd], [1.0]).sampler_logp_B_T.tolist() == [[0.0, pytest.approx(-0.4), 0.0]]


def test_collate_rejects_bad_input():
    with pytest.raises(ValueError, match="first token"):
        collate([trajectory(task_id="bad", ids=[1, 2], mask=[1, 1], logprobs=[-0.1, -0.2])], [1.0])
    with pytest.raises(ValueError, match="advantages"):
        collate([A, B], [1.0])


def test_micro_batches_by_token_budget():
    batch = collate([C, A, B], [0.1, 0.2, 0.3])
    # lengths C 2, A 6, B 3 -> longest first: A, B, C
    # budget 6: [A] (1*6), then B + C padded to 3: 2*3 = 6 fits
    mbs = micro_batches(batch, max_tokens=6)
    assert [mb.input_ids_B_T.tolist() for mb in mbs] == [
        [[10, 11, 12, 13, 14, 15]],
        [[20, 21, 22], [30, 31, 0]],
    ]
    assert mbs[1].loss_mask_B_T.tolist() == [[True, True, False], [True, False, False]]
    assert mbs[1].advantage_B.tolist() == [pytest.approx(0.3), pytest.approx(0.1)]
    # every micro-batch carries the step's normalisers, not its own
    assert all((mb.step_num_tokens, mb.step_num_sequences) == (6, 3) for mb in mbs)
    assert sum(int(mb.loss_mask_B_T.sum()) for mb in mbs) == 6
    # budget 5: A (6 tokens) goes alone over budget; B + C = 6 > 5 -> separate
    assert [mb.input_ids_B_T.shape[0] for mb in micro_batches(batch, max_tokens=5)] == [1, 1, 1]


def test_micro_batches_by_count():
    batch = collate([C, A, B], [0.1, 0.2, 0.3])
    mbs = micro_batches(batch, max_sequences=2)
    assert [mb.input_ids_B_T.shape for mb in mbs] == [(2, 6), (1, 2)]  # [A, B], [C] trimmed
    assert mbs[1].sampler_logp_B_T.tolist() == [[pytest.approx(-0.7), 0.0]]
    assert len(micro_batches(batch)) == 1
