"""Per-token log-probs and entropies of a causal LM, computed in chunks.

Owns: `token_logprobs` (log-probs and entropies of the next token at every position, or at the
positions asked for; the output layer and log-softmax run on a chunk of positions at a time; the
body on padded rows or packed ones), and `score` with its settings `Scoring`: the one way the trainer
scores a micro-batch (its sampled tokens), under the policy, pi_old's pass or the KL reference alike.
Does not own: building the model (`learn.policy`), the packed layout (`learn.packing`), the batch
(`learn.batching`), the KL reference (`learn.reference`), the loss, gradient accumulation, the optimizer.

Shift convention (as `learn.batching`): column t of `logp_B_T` is
log p(input_ids[t + 1] | input_ids[<= t]); the last column is 0.0.

Agreement with the sampler: logits are cast to float32 and divided by the sampling temperature
before the log-softmax, as vLLM's sampler does. vLLM returns those processed log-probs only when
started with `--logprobs-mode processed_logprobs` (its default reports raw, pre-temperature ones),
and only a full-vocabulary distribution matches: sample with top_p = 1, top_k = -1, or let the
importance weights of `learn.loss` absorb the difference.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from peft import PeftModel
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from agent_rl.learn.batching import Batch
from agent_rl.learn.packing import pack_rows, supports_packing


@dataclass(frozen=True)
class TokenLogprobs:
    """Per-position quantities of the next-token distribution (shift convention: module doc)."""

    logp_B_T: torch.Tensor  # float32 or wider: log p(token t+1 | <= t) at the temperature
    entropy_B_T: torch.Tensor  # entropy of that distribution, over the whole vocabulary; no gradient
    computed_tokens: int = 0  # positions the transformer body ran: B x T padded, fewer packed


@dataclass(frozen=True)
class Scoring:
    """How the trainer scores a micro-batch: what every log-prob pass of one update shares."""

    temperature: float = 1.0  # the sampler's: logits are divided by it
    chunk_size: int = 512  # tokens per chunk of the output layer and log-softmax (`optim.logprob_chunk`)
    share_prefixes: bool = False  # run the body packed (`learn.packing`; `learn.policy.Policy.share_prefixes`)


def score(model: nn.Module, mb: Batch, scoring: Scoring) -> TokenLogprobs:
    """Log-probs and entropies of `mb`'s sampled tokens (its loss mask; 0.0 at every other column) under
    `model`: the policy's gradient pass, pi_old's no-grad pass and the KL reference's all score this way."""
    return token_logprobs(model, mb.input_ids_B_T, mb.attention_mask_B_T, scoring.temperature, scoring.chunk_size,
                          mb.loss_mask_B_T, scoring.share_prefixes)


def _causal_lm(model: nn.Module) -> PreTrainedModel:
    # a PeftModel's base model holds the LoRA-injected layers, so going through it keeps LoRA on
    lm = model.get_base_model() if isinstance(model, PeftModel) else model
    if not isinstance(lm, PreTrainedModel):
        raise TypeError(f"{type(lm).__name__}: not a Hugging Face causal LM (nor a peft model of one)")
    return lm


def _chunk_logprobs(
    head: nn.Module, hidden_B_C_H: torch.Tensor, targets_B_C: torch.Tensor, temperature: float,
    entropy_out: list[torch.Tensor],
) -> torch.Tensor:
    logits_B_C_V = head(hidden_B_C_H)
    # at least float32, like vLLM's sampler (bf16 logits would round the log-softmax)
    logits_B_C_V = logits_B_C_V.to(torch.promote_types(logits_B_C_V.dtype, torch.float32))
    if temperature != 1.0:
        logits_B_C_V = logits_B_C_V / temperature
    logp_B_C_V = torch.log_softmax(logits_B_C_V, dim=-1)
    logp_B_C = logp_B_C_V.gather(-1, targets_B_C.unsqueeze(-1)).squeeze(-1)
    if not entropy_out:  # a statistic, without gradient, computed once: the checkpoint's recomputation of
        # this chunk in the backward pass skips it (a vocabulary-wide exp and product, each the size of the
        # logits, held at the backward pass's peak; in the graph they were kept until it ended)
        with torch.no_grad():
            entropy_out.append(-(logp_B_C_V.exp() * logp_B_C_V).sum(dim=-1))
    return logp_B_C


def token_logprobs(
    model: nn.Module,
    input_ids_B_T: torch.Tensor,
    attention_mask_B_T: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 512,
    positions_B_T: torch.Tensor | None = None,
    share_prefixes: bool = False,
) -> TokenLogprobs:
    """Log-probs of each next token and the entropy of each next-token distribution.

    The transformer body runs once over the whole batch; the output layer and the log-softmax run
    on about `chunk_size` tokens at a time (max(1, chunk_size // B) positions of all B rows), so at
    most ~chunk_size * vocab float32 logits exist at once, whatever the batch's shape. When gradients
    are on, each chunk is checkpointed: its logits are recomputed in the backward pass instead of
    being kept, otherwise autograd would hold all of them anyway.

    `positions_B_T` (bool, optional): compute only there, e.g. the loss mask; every other column is
    0.0. An agent's trajectory trains on a small share of its tokens (the prompt, tool outputs and
    earlier turns are context), and the vocabulary-wide output layer and log-softmax are a large share
    of a small model's work per position, so this skips most of that work.

    `share_prefixes`: run the body once over the rows packed (`learn.packing`: a prefix several rows
    share is computed once; same maths), for models `packing.supports_packing` accepts. Columns outside
    `positions_B_T` (outside the real tokens, without it) are then 0.0.
    Composable with gradient accumulation: nothing here touches `.grad` or the optimizer.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (got {temperature}); greedy has no log-probs")
    lm = _causal_lm(model)
    if getattr(lm.config, "final_logit_softcapping", None):
        # the output layer alone would miss the soft-capping the model's forward applies
        raise NotImplementedError("models with final_logit_softcapping are not supported")
    body, head = lm.get_decoder(), lm.get_output_embeddings()
    B, T = input_ids_B_T.shape
    if positions_B_T is not None and positions_B_T.shape != (B, T):
        raise ValueError(f"positions_B_T has shape {tuple(positions_B_T.shape)}, the batch {(B, T)}")
    if share_prefixes:
        return _packed_logprobs(lm, input_ids_B_T, attention_mask_B_T, temperature, chunk_size, positions_B_T)

    hidden_B_T_H = body(
        input_ids=input_ids_B_T, attention_mask=attention_mask_B_T, use_cache=False
    ).last_hidden_state
    if positions_B_T is not None:
        rows_N, cols_N, scale = _wanted(positions_B_T, hidden_B_T_H.device)
        out = _scattered(head, hidden_B_T_H[rows_N, cols_N], input_ids_B_T, rows_N, cols_N, scale, temperature,
                         chunk_size)
        return replace(out, computed_tokens=B * T)
    return _every_position(head, hidden_B_T_H, input_ids_B_T, temperature, chunk_size)


def _every_position(head: nn.Module, hidden_B_T_H: torch.Tensor, input_ids_B_T: torch.Tensor, temperature: float,
                    chunk_size: int) -> TokenLogprobs:
    """The output layer on max(1, chunk_size // B) positions of all B rows at a time."""
    B, T = input_ids_B_T.shape
    positions = max(1, chunk_size // B)
    logp_chunks, entropy_chunks = [], []
    for start in range(0, T - 1, positions):
        end = min(start + positions, T - 1)  # the last position predicts nothing
        targets_B_C = input_ids_B_T[:, start + 1 : end + 1]
        logp_B_C, entropy_B_C = _head_chunk(head, hidden_B_T_H[:, start:end], targets_B_C, temperature)
        logp_chunks.append(logp_B_C)
        entropy_chunks.append(entropy_B_C)
    out_dtype = torch.promote_types(hidden_B_T_H.dtype, torch.float32)
    last = hidden_B_T_H.new_zeros((B, 1), dtype=out_dtype)
    return TokenLogprobs(
        logp_B_T=torch.cat([*logp_chunks, last], dim=1),
        entropy_B_T=torch.cat([*entropy_chunks, last], dim=1),
        computed_tokens=B * T,
    )


def _packed_logprobs(lm: PreTrainedModel, input_ids_B_T: torch.Tensor, attention_mask_B_T: torch.Tensor,
                     temperature: float, chunk_size: int, positions_B_T: torch.Tensor | None) -> TokenLogprobs:
    """`token_logprobs` with the body run once over the rows packed (`learn.packing`)."""
    if not supports_packing(lm.config):
        raise ValueError(f"share_prefixes: the model's attention ({lm.config._attn_implementation}, or a "
                         "sliding window) cannot take a packed mask")
    packing = pack_rows(input_ids_B_T, attention_mask_B_T)
    mask = packing.attention_mask(lm.config._attn_implementation, lm.dtype)
    hidden_1_P_H = lm.get_decoder()(input_ids=packing.input_ids_1_P, position_ids=packing.position_ids_1_P,
                                    attention_mask=mask, use_cache=False).last_hidden_state
    if positions_B_T is None:  # every real token that has a next one
        positions_B_T = torch.cat([attention_mask_B_T[:, 1:].bool(),
                                   attention_mask_B_T.new_zeros((input_ids_B_T.shape[0], 1), dtype=torch.bool)],
                                  dim=1)
    rows_N, cols_N, scale = _wanted(positions_B_T, hidden_1_P_H.device)
    hidden_N_H = hidden_1_P_H[0, packing.slot_B_T[rows_N, cols_N]]
    out = _scattered(lm.get_output_embeddings(), hidden_N_H, input_ids_B_T, rows_N, cols_N, scale, temperature,
                     chunk_size)
    return replace(out, computed_tokens=int(packing.input_ids_1_P.shape[1]))


def _head_chunk(head: nn.Module, hidden_B_C_H: torch.Tensor, targets_B_C: torch.Tensor,
                temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    entropy_out: list[torch.Tensor] = []
    if torch.is_grad_enabled():
        logp_B_C = checkpoint(_chunk_logprobs, head, hidden_B_C_H, targets_B_C, temperature, entropy_out,
                              use_reentrant=False)
    else:
        logp_B_C = _chunk_logprobs(head, hidden_B_C_H, targets_B_C, temperature, entropy_out)
    return logp_B_C, entropy_out[0]


def _wanted(positions_B_T: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(rows, columns) of the positions to score (the last column predicts nothing), and 1.0; with none,
    position (0, 0) and 0.0: scored and scaled to 0, so that the graph still reaches every layer (a
    data-parallel rank with no sampled tokens must run the same backward as the others)."""
    wanted_B_T = positions_B_T.to(device=device, dtype=torch.bool).clone()
    wanted_B_T[:, -1] = False
    rows_N, cols_N = wanted_B_T.nonzero(as_tuple=True)
    if rows_N.numel() == 0:
        return rows_N.new_zeros(1), cols_N.new_zeros(1), 0.0
    return rows_N, cols_N, 1.0


def _scattered(head: nn.Module, hidden_N_H: torch.Tensor, input_ids_B_T: torch.Tensor, rows_N: torch.Tensor,
               cols_N: torch.Tensor, scale: float, temperature: float, chunk_size: int) -> TokenLogprobs:
    """Log-probs and entropies of the N hidden states given (row b, column t: predicting token t + 1),
    `chunk_size` at a time, in a [B, T] tensor that is 0.0 elsewhere."""
    targets_1_N = input_ids_B_T[rows_N, cols_N + 1].unsqueeze(0)
    hidden_1_N_H = hidden_N_H.unsqueeze(0)
    step = max(1, chunk_size)
    logp_chunks, entropy_chunks = [], []
    for start in range(0, hidden_1_N_H.shape[1], step):
        logp_1_C, entropy_1_C = _head_chunk(head, hidden_1_N_H[:, start:start + step],
                                            targets_1_N[:, start:start + step], temperature)
        logp_chunks.append(logp_1_C)
        entropy_chunks.append(entropy_1_C)
    logp_N, entropy_N = torch.cat(logp_chunks, dim=1)[0] * scale, torch.cat(entropy_chunks, dim=1)[0] * scale
    out = logp_N.new_zeros(input_ids_B_T.shape)
    return TokenLogprobs(logp_B_T=out.index_put((rows_N, cols_N), logp_N),
                         entropy_B_T=out.index_put((rows_N, cols_N), entropy_N))
