"""Trajectories plus advantages -> padded tensors, and the split into micro-batches.

Owns: `Batch` (the tensors of a rollout batch, of one optimizer step of it, or of one micro-batch),
`collate`, and every split of a batch: `split_steps` (a rollout batch into the mini-batches of several
optimizer steps, each with its own normalisers), `micro_batches` (one step into memory-sized pieces that
keep the step's normalisers), `rows_of` and `rank_micro_batches` (a step's rows dealt to data-parallel
ranks, `masked` fillers evening out their micro-batches), `share_rows` (columns each rank computed for
its rows, put together on every rank); and the shift convention every `_B_T` tensor of the trainer follows.
Does not own: which trajectories enter the batch (`learn.advantages`), log-probs (`learn.logprobs`),
the loss (`learn.loss`), the collectives (`learn.distributed`).

Shift convention. A causal LM's output at position t predicts token t + 1. So every per-token
tensor here is indexed by the *predicting* position: column t of `loss_mask_B_T`,
`sampler_logp_B_T` (and of the `logp_B_T` that `policy.token_logprobs` returns) describes token
t + 1 of `input_ids_B_T`:

    loss_mask_B_T[b, t]    = trajectory.loss_mask[t + 1]
    sampler_logp_B_T[b, t] = trajectory.logprobs[t + 1]
    version_B_T[b, t]      = trajectory.versions[t + 1]  (the policy version that sampled it)
    the last column and padding: mask False, logp 0.0, version -1

`advantage_B[b]` applies to every sampled token of every turn of row b, unless the batch carries
`advantage_B_T` (credit per turn, `learn.credit`): then column t holds the advantage of the turn that
sampled token t + 1, 0.0 elsewhere (`Batch.advantage` is whichever applies). Rows are right-padded
(`attention_mask_B_T` 0 on padding), so positions of real tokens are 0, 1, 2... as when sampled.

`collate` takes trajectories, or any rows with `token_ids` and `loss_mask` (SFT demonstrations, which
have no sampler log-probs: theirs are 0.0). A trajectory of several segments (`core.types`) becomes
one row per segment, each with the trajectory's advantage (and each turn's, with credit per turn, on the
row of the segment it was sampled in); so `step_num_sequences`, and hence `loss.sequence_mean`, counts
every segment as a sequence of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol

import torch

from agent_rl.learn.distributed import Dist, gather_objects, max_over_ranks
from agent_rl.learn.packing import prefix_order


@dataclass(frozen=True)
class Batch:
    """Padded tensors of some trajectories, plus the normalisers of the whole optimizer step.

    `step_num_tokens` / `step_num_sequences` are those of the step the batch was collated for,
    and micro-batches inherit them: pass them to `loss.token_mean` / `loss.sequence_mean` so
    micro-batch losses add up to the step's loss.
    """

    input_ids_B_T: torch.Tensor  # long
    attention_mask_B_T: torch.Tensor  # long, 1 on real tokens
    loss_mask_B_T: torch.Tensor  # bool: [b, t] is True when token t + 1 was sampled by the policy
    sampler_logp_B_T: torch.Tensor  # float32: [b, t] = the sampler's log-prob of token t + 1
    advantage_B: torch.Tensor  # float32
    step_num_tokens: int  # sampled tokens in the whole step
    step_num_sequences: int  # sequences of the whole step with at least one sampled token
    index_B: torch.Tensor | None = None  # long: each row's position in the batch `collate` made
    # long: [b, t] = the policy version that sampled token t + 1, -1 where not sampled or not known (rows
    # without versions: demonstrations); None: no row said
    version_B_T: torch.Tensor | None = None
    # the proximal policy's log-probs of the sampled tokens: the trainer's own, no-grad, before the update's
    # first optimizer step (only when the update's proximal rule asks for that pass: `learn.update`)
    proximal_logp_B_T: torch.Tensor | None = None
    # bool: the sampled tokens a mask correction keeps (`learn.update`: fixed before the first step, so that
    # a dropped token leaves the step's normalisers); None: every sampled token
    keep_B_T: torch.Tensor | None = None
    ref_logp_B_T: torch.Tensor | None = None  # the KL reference's log-probs (only when kl_beta > 0)
    # float32: [b, t] the advantage of the turn that sampled token t + 1 (credit per turn); None: advantage_B
    advantage_B_T: torch.Tensor | None = None

    @property
    def advantage(self) -> torch.Tensor:
        """What the loss weighs each sampled token by: `advantage_B_T` where the batch has it, else `advantage_B`."""
        return self.advantage_B if self.advantage_B_T is None else self.advantage_B_T

    @property
    def trained_mask_B_T(self) -> torch.Tensor:
        """bool: the tokens the loss trains on, and its normalisers count: sampled, less those a mask dropped."""
        return self.loss_mask_B_T if self.keep_B_T is None else self.loss_mask_B_T & self.keep_B_T

    def to(self, device: torch.device) -> Batch:
        """The same batch with every tensor on `device` (the trainer's)."""
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)

    def with_rows(self, rows_B: torch.Tensor, **columns: torch.Tensor) -> Batch:
        """Per-row tensors computed on some rows (e.g. a micro-batch: `rows_B` = its `index_B`,
        columns as wide as its own), written into full-size copies of this batch's."""
        out: dict[str, Any] = {}
        home = self.input_ids_B_T.device  # the rows may have been computed on the trainer's device
        keep = rows_B.to(home) >= 0  # -1: a filler row (`masked`), not a row of this batch
        for name, part in columns.items():
            full = getattr(self, name)
            full = (torch.zeros(self.input_ids_B_T.shape, dtype=part.dtype, device=home) if full is None
                    else full.clone())
            full[rows_B.to(home)[keep], : part.shape[1]] = part.to(home)[keep]
            out[name] = full
        return replace(self, **out)


class Row(Protocol):
    """What `collate` reads of a row: a `core.types.Trajectory` (its segments too), an SFT demonstration.
    Optional, read when present: `logprobs` (the sampler's; 0.0 without), `versions` (the policy version of
    each token; -1 without), `all_segments`, `task_id`."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def loss_mask(self) -> Sequence[int]: ...


def collate(trajectories: Sequence[Row], advantages: Sequence[float], pad_token_id: int = 0,
            turn_advantages: Sequence[Sequence[float]] | None = None) -> Batch:
    """Pad the trajectories of one optimizer step into a `Batch` (shift convention: module doc);
    `turn_advantages` (one per turn of each trajectory, `Trajectory.turns`): `advantage_B_T` as well."""
    if len(trajectories) != len(advantages):
        raise ValueError(f"{len(trajectories)} trajectories but {len(advantages)} advantages")
    if not trajectories:
        raise ValueError("cannot collate an empty list of trajectories")
    rows = [(getattr(traj, "task_id", "?"), seg, a) for traj, a in zip(trajectories, advantages)
            for seg in getattr(traj, "all_segments", (traj,))]
    B = len(rows)
    T = max(len(seg.token_ids) for _, seg, _ in rows)
    input_ids_B_T = torch.full((B, T), pad_token_id, dtype=torch.long)
    attention_mask_B_T = torch.zeros((B, T), dtype=torch.long)
    loss_mask_B_T = torch.zeros((B, T), dtype=torch.bool)
    sampler_logp_B_T = torch.zeros((B, T), dtype=torch.float32)
    version_B_T = torch.full((B, T), -1, dtype=torch.long)
    for b, (task_id, traj, _) in enumerate(rows):
        n = len(traj.token_ids)
        if n and traj.loss_mask[0]:
            # nothing predicts the first token, so it cannot be trained on
            raise ValueError(f"trajectory {task_id}: the first token cannot be sampled")
        input_ids_B_T[b, :n] = torch.tensor(traj.token_ids, dtype=torch.long)
        attention_mask_B_T[b, :n] = 1
        loss_mask_B_T[b, : n - 1] = torch.tensor(traj.loss_mask[1:], dtype=torch.bool)
        logprobs = getattr(traj, "logprobs", None) or (0.0,) * n
        sampled_logp = torch.tensor(logprobs[1:], dtype=torch.float32)
        # the sampler's value only where sampled: the trajectory promises 0.0 elsewhere, enforce it
        sampler_logp_B_T[b, : n - 1] = torch.where(loss_mask_B_T[b, : n - 1], sampled_logp, 0.0)
        if versions := getattr(traj, "versions", None):
            sampled_version = torch.tensor(versions[1:], dtype=torch.long)
            version_B_T[b, : n - 1] = torch.where(loss_mask_B_T[b, : n - 1], sampled_version, -1)
    return Batch(
        input_ids_B_T=input_ids_B_T,
        attention_mask_B_T=attention_mask_B_T,
        loss_mask_B_T=loss_mask_B_T,
        sampler_logp_B_T=sampler_logp_B_T,
        advantage_B=torch.tensor([a for _, _, a in rows], dtype=torch.float32),
        step_num_tokens=int(loss_mask_B_T.sum()),
        step_num_sequences=int(loss_mask_B_T.any(dim=1).sum()),
        index_B=torch.arange(B),
        version_B_T=version_B_T,
        advantage_B_T=None if turn_advantages is None else token_advantages(trajectories, turn_advantages, B, T),
    )


def token_advantages(trajectories: Sequence[Any], turn_advantages: Sequence[Sequence[float]], B: int,
                     T: int) -> torch.Tensor:
    """[B, T], rows as `collate` makes them (a row per segment): column t the advantage of the turn whose
    tokens [start, end) of that segment hold token t + 1 (`core.types.Turn`), 0.0 where no turn does."""
    if len(turn_advantages) != len(trajectories):
        raise ValueError(f"{len(trajectories)} trajectories but {len(turn_advantages)} lists of turn advantages")
    advantage_B_T = torch.zeros((B, T), dtype=torch.float32)
    b = 0
    for traj, advantages in zip(trajectories, turn_advantages):
        turns = getattr(traj, "turns", ())
        if len(advantages) != len(turns):
            raise ValueError(f"trajectory {getattr(traj, 'task_id', '?')}: {len(turns)} turns but "
                             f"{len(advantages)} turn advantages")
        for turn, a in zip(turns, advantages):
            advantage_B_T[b + turn.segment, turn.start - 1: turn.end - 1] = a
        b += len(getattr(traj, "all_segments", (traj,)))
    return advantage_B_T


def select_rows(batch: Batch, rows: Sequence[int]) -> Batch:
    """The given rows, trimmed to their longest real length (padding columns dropped): every per-row tensor
    (`_B` and `_B_T` columns alike) taken at those rows."""
    index = torch.as_tensor(list(rows), dtype=torch.long)
    length = int(batch.attention_mask_B_T[index].sum(dim=1).max())
    taken: dict[str, Any] = {}  # field name -> its rows (`replace` checks each name against the fields)
    for f in fields(batch):
        t = getattr(batch, f.name)
        if isinstance(t, torch.Tensor):
            taken[f.name] = t[index, :length] if t.dim() == 2 else t[index]
    return replace(batch, **taken)


def split_steps(batch: Batch, num_steps: int, generator: torch.Generator | None = None) -> list[Batch]:
    """The rows of a rollout batch, shuffled by `generator` (in order without one), dealt into
    `num_steps` mini-batches of near-equal size, one per optimizer step. Each mini-batch's
    normalisers are its own: an optimizer step averages over the tokens (or sequences) it trains on
    (`Batch.trained_mask_B_T`: a token a mask correction dropped is not counted).
    """
    n = batch.input_ids_B_T.shape[0]
    if not 1 <= num_steps <= n:
        raise ValueError(f"cannot split {n} rows into {num_steps} mini-batches")
    order = torch.randperm(n, generator=generator).tolist() if generator is not None else list(range(n))
    steps = []
    for k in range(num_steps):
        rows = order[k * n // num_steps:(k + 1) * n // num_steps]
        part = select_rows(batch, rows)
        trained = part.trained_mask_B_T
        steps.append(replace(part, step_num_tokens=int(trained.sum()),
                             step_num_sequences=int(trained.any(dim=1).sum())))
    return steps


def micro_batches(
    batch: Batch, max_tokens: int | None = None, max_sequences: int | None = None, share_prefixes: bool = False
) -> list[Batch]:
    """Split a step's batch into micro-batches of at most `max_tokens` padded tokens
    (rows * longest row: what activation memory scales with) and `max_sequences` rows.

    Rows are taken longest first: similar lengths share a micro-batch (less padding) and the
    largest micro-batch runs first, so an out-of-memory shows up on the first one. A row longer
    than `max_tokens` goes alone (a sequence cannot be split). Order does not change the summed
    loss, since every micro-batch keeps the step's normalisers.

    `share_prefixes` (micro-batches that `logprobs.token_logprobs` runs packed, `learn.packing`):
    `max_tokens` counts packed tokens instead, and rows are taken in lexicographic order of their
    tokens, so that rows sharing a prefix (a group's prompt, the tool schemas) share a micro-batch.
    """
    lengths = batch.attention_mask_B_T.sum(dim=1).tolist()
    if share_prefixes:
        return [select_rows(batch, rows) for rows in _packed_groups(batch, lengths, max_tokens, max_sequences)]
    order = sorted(range(len(lengths)), key=lambda b: (-lengths[b], b))
    groups: list[list[int]] = []
    current: list[int] = []
    for b in order:
        # lengths are non-increasing, so the group's longest row is its first
        longest = lengths[current[0]] if current else lengths[b]
        fits_tokens = max_tokens is None or (len(current) + 1) * longest <= max_tokens
        fits_rows = max_sequences is None or len(current) + 1 <= max_sequences
        if current and not (fits_tokens and fits_rows):
            groups.append(current)
            current = []
        current.append(b)
    if current:
        groups.append(current)
    return [select_rows(batch, rows) for rows in groups]


def rows_of(num_rows: int, dist: Dist) -> list[int]:
    """This rank's rows of an optimizer step: every world-th row, starting at the rank."""
    return list(range(dist.rank, num_rows, dist.world))


def masked(batch: Batch) -> Batch:
    """A copy of a one-row batch that trains on nothing (a filler micro-batch; `index_B` -1: no row)."""
    return replace(batch, loss_mask_B_T=torch.zeros_like(batch.loss_mask_B_T),
                   index_B=torch.full_like(batch.index_B, -1) if batch.index_B is not None else None)


def rank_micro_batches(step: Batch, dist: Dist, max_tokens: int, share_prefixes: bool = False) -> list[Batch]:
    """This rank's micro-batches of an optimizer step (rows dealt by `rows_of`), as many on every rank:
    masked fillers make up the difference (FSDP2 gathers layers in every forward pass, so every rank runs
    as many). One process: the step's own micro-batches. `share_prefixes`: as `micro_batches`."""
    rows = rows_of(step.input_ids_B_T.shape[0], dist)
    mine = micro_batches(select_rows(step, rows), max_tokens=max_tokens, share_prefixes=share_prefixes) if rows else []
    count = max_over_ranks(len(mine), dist)
    return mine + [masked(select_rows(step, [0]))] * (count - len(mine))


def share_rows(batch: Batch, dist: Dist, names: Sequence[str]) -> Batch:
    """The batch with the per-row columns `names` that each rank computed for its own rows (`rows_of`), put
    together on every rank. One process: the batch as it is."""
    if not dist.active:
        return batch
    mine = rows_of(batch.input_ids_B_T.shape[0], dist)
    for rows, columns in gather_objects((mine, {n: getattr(batch, n)[mine] for n in names}), dist):
        if rows:
            batch = batch.with_rows(torch.tensor(rows), **columns)
    return batch


def _packed_groups(batch: Batch, lengths: list[int], max_tokens: int | None,
                   max_sequences: int | None) -> list[list[int]]:
    """Runs of rows in prefix order whose packed length fits `max_tokens` (a longer row goes alone)."""
    rows = [batch.input_ids_B_T[b, :n].tolist() for b, n in enumerate(lengths)]
    order, shared = prefix_order(rows)
    groups: list[list[int]] = []
    current: list[int] = []
    cost = 0
    for b, s in zip(order, shared):
        extra = lengths[b] - min(s, lengths[b])  # beyond the prefix it shares with the row before it
        fits_tokens = max_tokens is None or cost + extra <= max_tokens
        fits_rows = max_sequences is None or len(current) + 1 <= max_sequences
        if current and not (fits_tokens and fits_rows):
            groups.append(current)
            current, extra = [], lengths[b]  # the first row of a micro-batch shares nothing
        current.append(b)
        cost = (cost if len(current) > 1 else 0) + extra
    if current:
        groups.append(current)
    return groups
