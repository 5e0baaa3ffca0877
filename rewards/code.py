"""Code rewards: run a submission's hidden tests in the sandbox and score the share that pass.

Owns: `extract_code` (the submission: the last ```python block of a reply), `split_check` (a
HumanEval-style `check(candidate)` cut into individual tests) and `run_hidden_tests` (one warm
sandboxed interpreter: load the program once, then each test as its own call with its own deadline).
Does not own: sandboxing and its limits (`tools.sandbox`), the episode or prompts (`envs.coding`).

How a test runs: the program (task prompt + submission) is loaded, then the check's preamble and a
small harness; each statement of `check`'s body that mentions `candidate` is one test, the others
(imports, `rng = ...`, `assert True`) are setup run in order. Statements run in a namespace copied
from the program's globals, so what `check` assigns (HumanEval/38 assigns `str`) stays out of the
submission's globals, as it would inside the original function. A test passes when its call ends
normally; an exception, SystemExit included, a timeout, a crash or an output flood fails it. A test
that kills the interpreter costs a restart: the program and the setup so far are loaded again.
After `max_timeouts` tests ran out of time the rest are not run and fail, so a program that loops
costs a few deadlines, not one per test.

The candidate is wrapped so that it may only return built-in values (numbers, strings, None and
containers of them): an object whose `__eq__` always says True would otherwise pass every
`assert candidate(x) == y`. The submission still runs in the tests' process and could patch
builtins; the sandbox bounds the damage, not the cheating.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from tools.sandbox import Backend

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_TOOL_CALL = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)

# Loaded after the program (again after a restart); names start with __grade_ to stay clear of the submission's.
HARNESS = '''
def __grade_plain(x):
    if type(x) in (bool, int, float, complex, str, bytes, type(None)):
        return True
    if type(x) in (list, tuple, set, frozenset):
        return all(map(__grade_plain, x))
    return type(x) is dict and all(__grade_plain(k) and __grade_plain(v) for k, v in x.items())

def __grade_guard(fn):
    def candidate(*args, **kwargs):
        out = fn(*args, **kwargs)
        if not __grade_plain(out):
            raise TypeError(f"candidate returned a {type(out).__name__}: only built-in values count")
        return out
    return candidate

def __grade_run(source):
    try:
        exec(source, __grade_ns)
    except BaseException:
        raise AssertionError("hidden test failed") from None

__grade_ns = dict(globals())
__grade_ns["candidate"] = __grade_guard(ENTRY_POINT)
'''


def extract_code(text: str) -> str | None:
    """The last fenced code block (```python, ```py or bare ```) outside tool calls, or None."""
    blocks = _FENCE.findall(_TOOL_CALL.sub(" ", text))
    return blocks[-1] if blocks else None


@dataclass(frozen=True)
class CheckStep:
    source: str
    is_test: bool  # mentions `candidate`; else setup, run but not scored


def split_check(test_source: str, arg: str = "candidate") -> tuple[str, list[CheckStep]]:
    """(preamble: the test module without `check`, the steps of `check`'s body in order).

    Raises ValueError when the source does not parse or defines no `check(candidate)`.
    """
    try:
        module = ast.parse(test_source)
    except SyntaxError as e:
        raise ValueError(f"test code does not parse: {e.msg} (line {e.lineno})") from None
    checks = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if len(checks) != 1 or [a.arg for a in checks[0].args.args] != [arg]:
        raise ValueError(f"test code must define exactly one check({arg}) function")
    preamble = ast.unparse(ast.Module([n for n in module.body if n is not checks[0]], type_ignores=[]))
    steps = [CheckStep(ast.unparse(s), any(isinstance(x, ast.Name) and x.id == arg for x in ast.walk(s)))
             for s in checks[0].body]
    if not any(s.is_test for s in steps):
        raise ValueError(f"check({arg}) has no statement that uses {arg}")
    return preamble, steps


@dataclass(frozen=True)
class TestReport:
    """Outcome of one submission's hidden tests."""

    compiled: bool  # the program ran and defined the entry point
    statuses: tuple[str, ...]  # per test: "ok", a sandbox status (error, timeout, ...) or "not_run"

    @property
    def passed(self) -> int:
        return self.statuses.count("ok")

    @property
    def share(self) -> float:
        return self.passed / len(self.statuses)


async def run_hidden_tests(backend: Backend, program: str, entry_point: str, test_source: str,
                           max_timeouts: int = 2) -> TestReport:
    """Run `check`'s tests against `entry_point` of `program`, each call within `backend.limits`
    (cpu_s bounds a busy loop whatever the machine's load; wall_s bounds one that sleeps)."""
    preamble, steps = split_check(test_source)
    harness = preamble + "\n" + HARNESS.replace("ENTRY_POINT", entry_point)
    n_tests = sum(s.is_test for s in steps)
    statuses: list[str] = []
    async with backend.session() as session:

        async def load(setup: list[str]) -> bool:
            if (await session.run(program)).status != "ok" or (await session.run(harness)).status != "ok":
                return False
            for source in setup:
                await session.run(f"__grade_run({source!r})")
            return True

        compiled = await load([])
        setup_done: list[str] = []
        lost, timeouts = False, 0
        for step in steps:
            if not compiled or timeouts >= max_timeouts:
                break
            if lost:
                await load(setup_done)
            result = await session.run(f"__grade_run({step.source!r})")
            lost = result.state_lost
            if step.is_test:
                statuses.append(result.status)
                timeouts += result.status == "timeout"
            else:
                setup_done.append(step.source)
    statuses += ["not_run"] * (n_tests - len(statuses))
    return TestReport(compiled, tuple(statuses))
