"""Config files: YAML in, `--set key=value` overrides, one-line errors, and YAML out.

Owns: `load_config` (a YAML file, then each override, validated into a `TrainConfig`; any mistake is one
`ConfigError` line naming the field) and `dump_config` (every field written out; `load_config` reads
it back).
Does not own: the sections and their rules (`config.train`, `core.config`, `learn.algorithm`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from agent_rl.config.train import TrainConfig
from agent_rl.core.config import ConfigError


def _one_line(e: ValidationError) -> ConfigError:
    """The first problem of a pydantic error, as `section.field: message (got value)`."""
    errors = e.errors()
    err = errors[0]
    loc = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        problem = "unknown field"
    elif err["type"] == "value_error":
        # our own validators: "Value error, <field>: <problem>" when they name a sibling field
        problem = err["msg"].removeprefix("Value error, ")
        head, sep, rest = problem.partition(": ")
        if sep and " " not in head:
            loc, problem = ".".join(p for p in (loc, head) if p), rest
    else:
        problem = f"{err['msg']} (got {_show(err.get('input'))})"
    if len(errors) > 1:
        problem += f" (and {len(errors) - 1} more)"
    return ConfigError(loc or "config", problem)


def _show(value: Any) -> str:
    """A value as the user wrote it in YAML (`-1`, `hot`, `[1, 2]`), on one line."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _parse_override(item: str) -> tuple[list[str], Any]:
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {item}", "expected key=value, e.g. algorithm.kl_beta=0.01")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(key, f"invalid YAML value {raw!r}: {getattr(e, 'problem', None) or e}") from None
    return key.split("."), value


def _set_path(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(".".join(path[: i + 1]), f"not a section, cannot set {'.'.join(path)}")
        node = child
    node[path[-1]] = value


def _read_yaml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(path, "file not found" if not p.exists() else "not a file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(path, f"invalid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(path, f"expected a mapping of sections (model, sampler, ...) (got {_show(data)})")
    # a section left empty (only comments under `rollout:`) means its defaults
    return {k: ({} if v is None else v) for k, v in data.items()}


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """The YAML file at `path` (None: all defaults), then each `key=value` override in order.

    Keys are dotted paths (`algorithm.kl_beta=0.01`); values are parsed as YAML, so
    `sampler.server_urls=[http://a,http://b]` is a list and `model.init_adapter=null` is None.
    Raises `ConfigError` (one line naming the field) on any mistake.
    """
    data = _read_yaml(path) if path is not None else {}
    for item in overrides:
        keys, value = _parse_override(item)
        _set_path(data, keys, value)
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        raise _one_line(e) from None


def dump_config(cfg: TrainConfig) -> str:
    """The whole config as YAML, every field written out, in declaration order; `load_config` reads it back."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=False)
