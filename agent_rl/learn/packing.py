"""Shared-prefix packing: the rows of a micro-batch as one sequence in which a prefix that several rows
share is computed once.

Owns: `pack_rows` (the layout: tokens, positions and the attention mask of the packed sequence, and
where each row's tokens went), `packed_lengths` (what a set of rows costs packed: the micro-batcher's
measure), `prefix_order` and `supports_packing` (which models can run it).
Does not own: running the model or log-probs (`learn.logprobs`), forming micro-batches
(`learn.batching`).

Why. An agent's trajectories repeat a long prefix: every rollout of a step starts with the same
system prompt and tool schemas, and the G rollouts of a group share their task's whole prompt (on the
GUI environment ~1,000 of a rollout's ~1,500 tokens). Padded rows recompute that prefix once per
row. Packed, the rows are sorted lexicographically by their tokens (rows with a long common prefix
become neighbours; the longest prefix a row shares with any earlier row is the one it shares with the
row just before it) and each row contributes only the tokens after that shared prefix. Each token
attends to the tokens of its own row's prefix and to its own row's earlier tokens, at the position it
has in its row, so every hidden state equals the one the row would get alone: the model's maths are
unchanged, only fewer tokens are computed. Gradients through a shared token add up over the rows
that share it, as they would have separately.

What it needs of the model: an attention that takes an explicit (query, key) mask and position ids.
Hugging Face models with `sdpa` or `eager` attention and no sliding window do (`supports_packing`);
others (flash-attention kernels, sliding-window layers, whose window a custom mask would override)
run rows padded as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packing:
    """One packed sequence of P tokens standing for the B rows of a micro-batch."""

    input_ids_1_P: torch.Tensor  # long
    position_ids_1_P: torch.Tensor  # long: each token's position in its row
    attend_P_P: torch.Tensor  # bool: [q, k] True where token q may attend to token k
    slot_B_T: torch.Tensor  # long: where row b's token t is in the packed sequence; -1 on padding

    def attention_mask(self, implementation: str, dtype: torch.dtype) -> torch.Tensor:
        """The 4-D mask a Hugging Face model takes as-is: boolean for sdpa, additive for eager."""
        mask_1_1_P_P = self.attend_P_P[None, None]
        if implementation == "sdpa":
            return mask_1_1_P_P
        blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=mask_1_1_P_P.device)
        return torch.where(mask_1_1_P_P, torch.zeros((), dtype=dtype, device=mask_1_1_P_P.device), blocked)


def supports_packing(config) -> bool:
    """Whether a model with this Hugging Face config computes the same hidden states packed."""
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    if any("sliding" in str(kind) for kind in getattr(config, "layer_types", None) or ()):
        return False
    return not (getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def prefix_order(rows: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """The rows' indices in lexicographic order of their tokens, and for each row in that order the
    length of the prefix it shares with the row before it (0 for the first)."""
    order = sorted(range(len(rows)), key=lambda b: (list(rows[b]), b))
    shared = [0] + [_common_prefix(rows[p], rows[b]) for p, b in zip(order, order[1:])]
    return order, shared


def packed_lengths(lengths: Sequence[int], shared: Sequence[int]) -> int:
    """Tokens of rows packed in the order they are given, each sharing `shared[i]` tokens with the one
    before (`prefix_order`'s second list, restarted at 0 for a micro-batch's first row)."""
    return sum(n - min(s, n) for n, s in zip(lengths, shared))


def pack_rows(input_ids_B_T: torch.Tensor, attention_mask_B_T: torch.Tensor) -> Packing:
    """The layout that computes the right-padded rows of a micro-batch once per distinct prefix."""
    lengths = attention_mask_B_T.sum(dim=1).tolist()
    rows = [input_ids_B_T[b, :n].tolist() for b, n in enumerate(lengths)]
    order, shared = prefix_order(rows)
    B, T = input_ids_B_T.shape
    slot_B_T = torch.full((B, T), -1, dtype=torch.long)
    ids: list[int] = []  # per packed token: its id, its position in its row
    positions: list[int] = []
    owners: list[tuple[int, int, int]] = []  # per row: (row, tokens it shares, its length)
    previous = None
    for b, s in zip(order, shared):
        n = lengths[b]
        s = min(s, n)
        if s:
            slot_B_T[b, :s] = slot_B_T[previous, :s]
        slot_B_T[b, s:n] = torch.arange(len(ids), len(ids) + n - s)
        ids.extend(rows[b][s:])
        positions.extend(range(s, n))
        owners.append((b, s, n))
        previous = b
    P = len(ids)
    attend_P_P = torch.zeros((P, P), dtype=torch.bool)
    for b, s, n in owners:
        if s == n:
            continue
        slots_n = slot_B_T[b, :n]
        causal = torch.ones((n, n), dtype=torch.bool).tril()[s:]  # the row's new tokens: its prefix and themselves
        attend_P_P[slots_n[s:, None], slots_n[None, :]] = causal
    device = input_ids_B_T.device
    return Packing(
        input_ids_1_P=torch.tensor([ids], dtype=input_ids_B_T.dtype, device=device),
        position_ids_1_P=torch.tensor([positions], dtype=torch.long, device=device),
        attend_P_P=attend_P_P.to(device),
        slot_B_T=slot_B_T.to(device),
    )
