"""The environment contract: a module exports one `EnvSpec` as `ENV` and the registry reads it; a module
written before 0.1.0 (make_env and load_tasks by name, or agent-rl's packages under their top-level names) is
one error line saying what changed; anything else is one error line naming the module."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
from helpers import one_error_line

from agent_rl.cli import main
from agent_rl.core.audit_target import ANSWERED, AuditTarget, NotAudited
from agent_rl.core.registry import BUILTIN, EnvSpec, load_env

NEW_STYLE = '''
from agent_rl.core.audit_target import NotAudited
from agent_rl.core.registry import EnvSpec


def make_env(task):
    return task


def load_tasks(n, seed=0, split="train", level=1):
    return [{"id": f"t{i}", "level": level} for i in range(n)]


def solve(task, messages, direct=False):
    return None


ENV = EnvSpec("spec_name", make_env, load_tasks, solve=solve, audit=NotAudited("is a test"))
'''
OLD_STYLE = '''
def make_env(task):
    return task


def load_tasks(n, seed=0, split="train"):
    return [{"id": f"t{i}"} for i in range(n)]


def solve(task, messages, direct=False):
    return None


def mistake(task, messages, rng):
    return None
'''


def test_a_module_exports_its_spec_and_the_registry_names_it_by_the_name_asked_for(user_folder, capsys):
    (user_folder / "new_env_a.py").write_text(NEW_STYLE)
    spec = load_env("new_env_a")
    module = importlib.import_module("new_env_a")
    assert spec.name == "new_env_a" and module.ENV.name == "spec_name"
    assert (spec.make_env, spec.solve, spec.group_reward, spec.mistake) == (module.make_env, module.solve, None, None)
    assert spec.audit == NotAudited("is a test")
    assert load_env("./new_env_a.py").name == "./new_env_a.py"
    bound = spec.with_task_args({"level": 3})
    assert bound.load_tasks(1) == [{"id": "t0", "level": 3}] and bound.audit is spec.audit
    assert capsys.readouterr().err == ""  # no notice for a module that exports its spec


def test_a_module_written_before_0_1_0_is_one_error_line_saying_what_changed(user_folder, capsys):
    """make_env and load_tasks by name were read until 0.1.0 (with a notice); now the line says what to write."""
    (user_folder / "old_env_b.py").write_text(OLD_STYLE)
    assert main(["play", "old_env_b"]) == 2
    assert one_error_line(capsys) == (
        "error: environment module 'old_env_b' defines make_env and load_tasks by name, which agent-rl no longer "
        'reads (0.1.0); export its spec: ENV = EnvSpec("old_env_b", make_env, load_tasks, solve=solve, '
        'mistake=mistake) (from agent_rl.core.registry import EnvSpec)')
    (user_folder / "reuse_env_f.py").write_text("from agent_rl.envs.calculator import load_tasks, make_env, solve\n"
                                                 "def group_reward(task, trajectories):\n    return None\n")
    with pytest.raises(ValueError, match=r"^environment module 'reuse_env_f' defines make_env and load_tasks by name.*"
                                         r'ENV = EnvSpec\("reuse_env_f", make_env, load_tasks, solve=solve, '
                                         r"group_reward=group_reward\)"):
        load_env("reuse_env_f")


def test_a_module_importing_the_top_level_spelling_of_before_0_1_0_is_one_error_line(user_folder, capsys,
                                                                                      monkeypatch):
    """A user's project with its own `envs` package, whose module still imports agent-rl's environments as
    `envs.calculator`: one line naming the new import (Python alone would say only "No module named")."""
    (user_folder / "envs").mkdir()
    own = types.ModuleType("envs")
    own.__path__ = [str(user_folder / "envs")]  # the user's own envs package, found first
    monkeypatch.setitem(sys.modules, "envs", own)
    (user_folder / "old_import_env_g.py").write_text("from envs.calculator import load_tasks, make_env\n")
    assert main(["play", "old_import_env_g"]) == 2
    assert one_error_line(capsys) == (
        "error: environment 'old_import_env_g' failed to import: No module named 'envs.calculator'; agent-rl's envs "
        "package is agent_rl.envs since 0.1.0: import agent_rl.envs.calculator")


@pytest.mark.parametrize("name, text, message", [
    ("dict_env_c", "ENV = {'make_env': None}\n",
     "environment module 'dict_env_c': its ENV is a dict, not an EnvSpec; write "
     'ENV = EnvSpec("dict_env_c", make_env, load_tasks) (from agent_rl.core.registry import EnvSpec)'),
    ("empty_env_d", "x = 1\n",
     "environment module 'empty_env_d' lacks ENV: an environment module exports "
     'ENV = EnvSpec("empty_env_d", make_env, load_tasks) (from agent_rl.core.registry import EnvSpec)'),
    ("half_env_e", "def load_tasks(n, seed=0, split='train'):\n    return []\n\ndef solve(t, m, d):\n    pass\n",
     "environment module 'half_env_e' defines load_tasks by name, which agent-rl no longer reads (0.1.0); export "
     'its spec: ENV = EnvSpec("half_env_e", make_env, load_tasks, solve=solve) '
     "(from agent_rl.core.registry import EnvSpec)"),
])
def test_a_module_without_a_spec_is_one_error_line_saying_what_to_write(user_folder, capsys, name, text,
                                                                        message):
    (user_folder / f"{name}.py").write_text(text)
    assert main(["play", name]) == 2
    assert one_error_line(capsys) == f"error: {message}"


@pytest.mark.parametrize("name", BUILTIN)
def test_every_built_in_environment_exports_one_spec_named_env(name, capsys):
    module = importlib.import_module(BUILTIN[name])
    specs = [k for k, v in vars(module).items() if isinstance(v, EnvSpec)]
    assert specs == ["ENV"] and module.ENV.name == name
    assert load_env(name).audit is module.ENV.audit
    if name not in ("toy", "text_game"):  # neither states an answer for a hack to fake: NotAudited (below)
        assert module.ENV.solve is not None and isinstance(module.ENV.audit, AuditTarget)
    assert capsys.readouterr().err == ""


def test_the_built_in_audit_targets_name_what_applies():
    # by hand, from the environments' rewards: the answer and tool hacks where one final answer is graded, and
    # the hacks on turn rewards where the environment can give them (calculator, kg_qa, coding, gui)
    audits = {name: load_env(name).audit for name in BUILTIN}
    assert {n for n, a in audits.items() if isinstance(a, AuditTarget) and a.hacks == ANSWERED} == \
        {"math", "search_qa", "mcp_units", "mcp_time"}
    assert audits["calculator"].hacks == audits["kg_qa"].hacks == (*ANSWERED, "turn")
    assert audits["gui"].hacks == audits["gui_browser"].hacks == ("empty_reply", "echo_question", "gui", "turn")
    assert audits["coding"].hacks[-2:] == ("coding", "busy_calls") and isinstance(audits["toy"], NotAudited)
    assert isinstance(audits["text_game"], NotAudited)  # the game judges its moves; no answer is stated
