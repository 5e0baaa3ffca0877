"""What every config section shares: the one error a mistake becomes, and the frozen, strict base model.

Owns: `ConfigError` (one line naming the field) and `_Section` (frozen, `extra="forbid"`, defaults validated).
Does not own: any section (`core.config`, `core.config_algorithm`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A config mistake; `str(e)` is one line, `config error: <field>: <problem>`."""

    def __init__(self, where: str, problem: str):
        super().__init__(f"config error: {where}: {problem}")
        self.where = where
        self.problem = problem


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)
