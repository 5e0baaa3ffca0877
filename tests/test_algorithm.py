"""The `algorithm` section reads each choice from the one table of its functions: every table key is a name the
config allows and every name it allows is a key (a bad one is one line listing them); a loss's row fills in the
fields a config leaves out; and the diff docs/algorithms.md shows for adding a loss applies and computes. Nothing
is registered anywhere: the tables are read as they are, the diff runs in a copy of the module."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

from agent_rl.config.file import load_config
from agent_rl.core.config import ConfigError
from agent_rl.learn import loss as loss_module
from agent_rl.learn.advantages import ESTIMATORS
from agent_rl.learn.algorithm import CHOICES, AlgorithmConfig
from agent_rl.learn.credit import CREDITS
from agent_rl.learn.loss import AGGREGATIONS, LOSSES, MISMATCH_MASKS, ppo_clip_loss

ROOT = Path(__file__).resolve().parents[1]
# written out here, not read from the section: a choice the section forgets to check against its table fails
TABLES = {"advantage": ESTIMATORS, "loss": LOSSES, "aggregation": AGGREGATIONS, "mismatch_mask": MISMATCH_MASKS,
          "credit": CREDITS}


def test_every_choice_of_the_section_has_its_table():
    names = {n for n, f in AlgorithmConfig.model_fields.items() if f.annotation in (str, str | None)}
    assert names == set(TABLES) and CHOICES == TABLES


@pytest.mark.parametrize("field", TABLES)
def test_every_table_key_is_allowed_and_every_allowed_name_is_a_key(field):
    for name in TABLES[field]:
        assert getattr(load_config(None, [f"algorithm.{field}={name}"]).algorithm, field) == name
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"algorithm.{field}=nope"])
    # the allowed names, as the one error line lists them: exactly the keys, in table order
    listed = re.fullmatch(rf"config error: algorithm\.{field}: must be one of (.*) \(got nope\)", str(e.value))
    assert listed is not None, str(e.value)
    assert listed.group(1).split(", ") == list(TABLES[field])


def test_each_loss_fills_in_its_row_where_a_config_leaves_it_out():
    for name, row in LOSSES.items():
        algo = load_config(None, [f"algorithm.loss={name}"]).algorithm
        assert (algo.eps_low, algo.eps_high, algo.aggregation) == (row.eps_low, row.eps_high, row.aggregation)
        assert row.aggregation in AGGREGATIONS
        assert load_config(None, [f"algorithm.loss={name}", "algorithm.eps_low=0.1"]).algorithm.eps_low == 0.1
    assert AlgorithmConfig().eps_high == LOSSES[AlgorithmConfig().loss].eps_high  # the default loss's row


def test_credit_rows_name_the_fields_they_read_and_the_loss_they_need():
    assert {f for row in CREDITS.values() for f in row.reads} <= set(AlgorithmConfig.model_fields)
    with pytest.raises(ConfigError, match=r"^config error: algorithm\.credit: turn gives each turn its own "
                                          r"advantage, but loss: gspo has one ratio and one advantage per sequence; "
                                          r"use loss: ppo, or credit: trajectory$"):
        load_config(None, ["algorithm.credit=turn", "algorithm.loss=gspo"])
    with pytest.raises(ConfigError, match=r"^config error: algorithm\.step_weight: read only with credit: gigpo, so "
                                          r"it would change nothing \(got credit: turn\)$"):
        load_config(None, ["algorithm.credit=turn", "algorithm.step_weight=0.5"])


# --- the diff of docs/algorithms.md ---------------------------------------------------------------------


def _doc_diff() -> str:
    text = (ROOT / "docs" / "algorithms.md").read_text()
    (diff,) = re.findall(r"```diff\n(.*?)```", text, re.S)
    return diff


def _apply(diff: str, source: str) -> str:
    """`source` with each hunk of `diff` applied: its context and removed lines found once, in order, and
    replaced by its context and added lines (hunk headers carry no line numbers)."""
    for hunk in re.split(r"^@@.*\n", diff, flags=re.M)[1:]:
        lines = hunk.splitlines()
        before = "\n".join(line[1:] for line in lines if line[:1] in (" ", "-") or line == "")
        after = "\n".join(line[1:] for line in lines if line[:1] in (" ", "+") or line == "")
        assert source.count(before) == 1, f"the doc's diff no longer applies to learn/loss.py:\n{before}"
        source = source.replace(before, after)
    return source


def test_the_docs_diff_adding_a_loss_applies_and_computes(monkeypatch):
    diff = _doc_diff()
    assert "--- a/agent_rl/learn/loss.py" in diff
    patched = types.ModuleType("patched_loss")  # a copy: the real module and its table untouched
    monkeypatch.setitem(sys.modules, "patched_loss", patched)  # for its dataclasses, while the test runs
    exec(compile(_apply(diff, Path(loss_module.__file__).read_text()), "patched_loss.py", "exec"), patched.__dict__)
    added = set(patched.LOSSES) - set(LOSSES)
    assert added == {"cispo"} and set(LOSSES) == {"ppo", "gspo"}
    row = patched.LOSSES["cispo"]
    assert row.aggregation in AGGREGATIONS and (row.eps_low, row.eps_high) == (0.2, 0.28)
    # by hand: one row, ratios e^0 = 1 (inside the clip) and e^0.5 = 1.6487 (above 1 + 0.28), A = 2. At ratio 1
    # CISPO's gradient is PPO's, -A; where PPO's clip drops the token's gradient, CISPO's weight is 1.28: -2.56
    old = torch.tensor([[-1.0, -1.5]], dtype=torch.float64)
    mask = torch.tensor([[True, True]])
    grads = {}
    for name, fn in (("ppo", ppo_clip_loss), ("cispo", row.fn)):
        logp = torch.tensor([[-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
        out = fn(logp, old, torch.tensor([2.0], dtype=torch.float64), mask, 0.2, 0.28)
        out.loss_B_T.sum().backward()
        grads[name] = logp.grad[0].tolist()
    assert grads["ppo"] == pytest.approx([-2.0, 0.0], abs=1e-12)
    assert grads["cispo"] == pytest.approx([-2.0, -2.56], abs=1e-12)
