"""Training checkpoints: everything needed to resume a run exactly where it stopped.

Owns: writing `<run_dir>/checkpoints/step-{step:06d}` atomically (trainable weights, optimizer and
scheduler state, Python/NumPy/torch RNG states, data position, caller's extras), the `latest`
pointer file, keeping the newest N, and loading the newest *complete* checkpoint back, into plain
or sharded (FSDP2) parameters alike.
Does not own: the adapters served to vLLM (`rollout.weight_sync`), the training loop, the data pipeline
(it only stores the position the caller hands in), gathering sharded state (`learn.distributed`).

Atomicity (`core.files`): files are written into a `checkpoints/.tmp-step-*` folder, a
`manifest.json` with each file's size and sha256 last, everything fsynced, then the folder is renamed
to `step-*` and `latest` is replaced (write temp + fsync + `os.replace`). A kill at any point leaves either the previous
checkpoint as `latest` or the new one complete. Loading verifies the manifest and falls back to the
newest older checkpoint that verifies; temp folders are never loaded and are removed by the next save.

Weights stored are the trainable parameters (`requires_grad`): the LoRA adapter, or every weight
under full fine-tuning. Frozen weights come from the model folder the run started from. Stored whole,
whatever the number of ranks that trained them: a run sharded over ranks (FSDP2 full fine-tuning) hands
in its weights and optimizer state gathered on rank 0, and on loading each rank takes its own shard of
every saved tensor, so a checkpoint resumes under any number of ranks, one included.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from agent_rl.core.files import atomic_dir, write_text

log = logging.getLogger(__name__)

FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
_WEIGHTS, _OPTIMIZER, _SCHEDULER, _RNG, _STATE, _MANIFEST = (
    "weights.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "state.json", "manifest.json")


class CheckpointError(Exception):
    """A checkpoint that verifies but does not fit the model/optimizer it is loaded into, or one that could not
    be written (a full disk: the checkpoints before it stay readable)."""


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: what the training loop needs beyond the restored objects."""

    step: int
    path: Path
    data_position: Any  # whatever the caller saved (JSON)
    extra: dict[str, Any] = field(default_factory=dict)


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    scheduler: Any | None, *, data_position: Any, extra: dict[str, Any] | None = None,
                    keep: int = 3, weights: dict[str, torch.Tensor] | None = None,
                    optimizer_state: dict[str, Any] | None = None) -> Path:
    """Write checkpoint `step` atomically, point `latest` at it, keep the newest `keep`.

    `data_position` and `extra` must be JSON-serialisable. `weights` and `optimizer_state` stand in for
    the model's trainable weights and the optimizer's `state_dict()` where those are sharded over ranks:
    the caller gathered them whole (`learn.distributed.full_state_dict`, `full_optimizer_state`).
    Checkpoints with a step above `step` are deleted: they belong to a timeline abandoned when the run
    resumed from an older checkpoint.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (got {keep})")
    state = {"format": FORMAT, "step": step, "data_position": data_position, "extra": extra or {}}
    state_json = json.dumps(state, indent=1)  # fails here, before anything is written, if not JSON
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # left by a run killed mid-save
        shutil.rmtree(stale, ignore_errors=True)

    final = root / f"step-{step:06d}"
    with atomic_dir(final, durable=True) as tmp:  # the same step saved again after a resume: replaced
        save_file(_trainable_state(model, weights), tmp / _WEIGHTS)
        if optimizer_state is None and optimizer is not None:
            optimizer_state = optimizer.state_dict()
        torch.save(optimizer_state, tmp / _OPTIMIZER)
        torch.save(scheduler.state_dict() if scheduler is not None else None, tmp / _SCHEDULER)
        torch.save(_rng_state(), tmp / _RNG)
        (tmp / _STATE).write_text(state_json)
        files = {name: {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
                 for name in (_WEIGHTS, _OPTIMIZER, _SCHEDULER, _RNG, _STATE)}
        (tmp / _MANIFEST).write_text(json.dumps({"format": FORMAT, "step": step, "files": files}, indent=1))
    write_text(root / "latest", final.name + "\n")
    _prune(root, step, keep)
    return final


def load_checkpoint(run_dir: str | Path, model: nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None, scheduler: Any | None = None,
                    *, restore_rng: bool = True) -> Checkpoint | None:
    """Restore the newest complete checkpoint into the given objects; None when there is none.

    The one `latest` names is tried first, then older ones, newest first; a folder that does not
    verify (missing or truncated file, bad checksum) is skipped with a warning, never loaded.
    A checkpoint that verifies but does not fit `model` raises `CheckpointError`.
    """
    root = checkpoints_dir(run_dir)
    candidates = sorted(_step_dirs(root), reverse=True)
    latest = root / "latest"
    if latest.is_file():
        name = latest.read_text().strip()
        m = _STEP_DIR.match(name)
        if m:  # latest first, then everything else newest first
            candidates = [(int(m.group(1)), root / name)] + [c for c in candidates if c[1].name != name]
    for _, path in candidates:
        problem = _verify(path)
        if problem:
            log.warning("skipping checkpoint %s: %s", path, problem)
            continue
        return _restore(path, model, optimizer, scheduler, restore_rng)
    return None


def _restore(path: Path, model: nn.Module | None, optimizer: Any, scheduler: Any, restore_rng: bool) -> Checkpoint:
    state = json.loads((path / _STATE).read_text())
    if model is not None:
        saved = load_file(path / _WEIGHTS)
        params = dict(_trainable(model))
        if saved.keys() != params.keys():
            missing, unexpected = sorted(params.keys() - saved.keys()), sorted(saved.keys() - params.keys())
            raise CheckpointError(f"checkpoint {path} does not fit the model: missing {missing[:3]} "
                                  f"({len(missing)}), unexpected {unexpected[:3]} ({len(unexpected)})")
        with torch.no_grad():
            for name, p in params.items():
                if p.shape != saved[name].shape:
                    raise CheckpointError(f"checkpoint {path}: {name} has shape {tuple(saved[name].shape)}, "
                                          f"the model {tuple(p.shape)}")
                _own_part(p).copy_(_own_part(_shard_like(saved[name], p)))
    if optimizer is not None:
        optimizer.load_state_dict(_sharded_moments(torch.load(path / _OPTIMIZER, weights_only=True), optimizer))
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(path / _SCHEDULER, weights_only=True))
    if restore_rng:
        _set_rng_state(torch.load(path / _RNG, weights_only=True))
    return Checkpoint(step=state["step"], path=path, data_position=state["data_position"], extra=state["extra"])


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _trainable_state(model: nn.Module, gathered: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    if gathered is not None:
        names = {n for n, _ in _trainable(model)}
        state = {n: t.contiguous() for n, t in gathered.items() if n in names}
    else:
        state = {n: p.detach().contiguous().cpu() for n, p in _trainable(model)}
    if not state:
        raise CheckpointError("the model has no trainable parameters: nothing to checkpoint")
    return state


def _shard_like(whole: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`whole` laid out as `param`: for a sharded parameter (an FSDP2 DTensor, several ranks) a DTensor
    holding this rank's shard, split locally (every rank read the same file); else `whole` itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        return whole
    return distribute_tensor(whole.to(param.device), param.device_mesh, param.placements, src_data_rank=None)


def _own_part(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


def _sharded_moments(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A saved optimizer state (whole tensors) fitted to the optimizer's parameters: each moment of a
    sharded parameter becomes the DTensor shard this rank holds. Unsharded: `state` as it is."""
    from torch.distributed.tensor import DTensor

    for saved_group, group in zip(state["param_groups"], optimizer.param_groups):
        for pid, p in zip(saved_group["params"], group["params"]):
            if not isinstance(p, DTensor) or pid not in state["state"]:
                continue
            state["state"][pid] = {k: _shard_like(v, p) if isinstance(v, torch.Tensor) and v.shape == p.shape else v
                                   for k, v in state["state"][pid].items()}
    return state


def _rng_state() -> dict[str, Any]:
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # the tuple form
    state = {"python": [version, list(mt), gauss],
             "numpy": [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss),
                       float(cached)],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _verify(path: Path) -> str | None:
    """None when the folder is complete and intact, else what is wrong with it."""
    try:
        manifest = json.loads((path / _MANIFEST).read_text())
        for name, want in manifest["files"].items():
            f = path / name
            if not f.is_file():
                return f"{name} is missing"
            if f.stat().st_size != want["bytes"]:
                return f"{name} has {f.stat().st_size} bytes, the manifest says {want['bytes']}"
            if _sha256(f) != want["sha256"]:
                return f"{name} does not match its checksum"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"no readable manifest ({type(e).__name__}: {e})"
    return None


def latest_step(run_dir: str | Path) -> int | None:
    """The step of the newest checkpoint that verifies (the one `load_checkpoint` would read), or None."""
    return next((step for step, path in sorted(_step_dirs(checkpoints_dir(run_dir)), reverse=True)
                 if _verify(path) is None), None)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    return [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]


def _prune(root: Path, current: int, keep: int) -> None:
    older = sorted((s for s in _step_dirs(root) if s[0] < current), reverse=True)
    newer = [s for s in _step_dirs(root) if s[0] > current]
    for _, path in older[keep - 1 :] + newer:
        shutil.rmtree(path, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()



