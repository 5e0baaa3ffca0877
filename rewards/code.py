"""Code rewards: run a submission's hidden tests in the sandbox and score the share that pass.

Owns: `extract_code` (the submission: the last ```python block of a reply), `split_check` (a
HumanEval-style `check(candidate)` cut into individual tests) and `run_hidden_tests` (the tests in
one warm sandboxed interpreter, the submission in a process of its own that the tests call).
Does not own: sandboxing and its limits (`tools.sandbox`), the episode or prompts (`envs.coding`).

Two processes, so that only what the submission returns can pass a test. The tests' process (the
sandbox session) loads the task's prompt (its helpers: `poly`, `encode_cyclic`...), the test
preamble and a harness whose `candidate` sends each call's arguments to the submission's process,
a child it starts, and reads back the return value. Both ways, values travel as tagged JSON of
built-in types only (None, bool, int, float, complex, str, bytes, list, tuple, set, frozenset,
dict; no subclasses), so an object whose `__eq__` always says True cannot exist on the tests' side.
The submission never shares an interpreter with the tests: it cannot patch `exec`, `assert` or the
harness, read the tests from memory or redefine the prompt's helpers. Before starting the child
the tests' process makes itself non-dumpable (no ptrace, no /proc/PID/mem or fd of it for the
child), drops the writable working directory from `sys.path` (a module the child writes to /tmp
is never imported) and imports what it will need. The tests never exist on disk.

How a test runs: each statement of `check`'s body that mentions `candidate` is one test, the others
(imports, `rng = ...`, `assert True`) are setup run in order. Statements run in a namespace copied
from the tests' globals, so what `check` assigns (HumanEval/38 assigns `str`) stays out of them;
there the entry point's name is the candidate too, as in HumanEval's own harness. A test passes
when its statement ends normally; an exception in either process, a crash of the submission's
process or a timeout fails it. The submission's process loads the program once (the prompt, then
the submission: a whole module, or only the function's body, which then completes the prompt's
`def` as in HumanEval itself) and is restarted after it dies. A program that raises or exits while
loading, or leaves the entry point doing nothing (the prompt's bare stub, echoed back, or a body
that only returns None), does not compile: it scores 0. A call that runs out of CPU time ends the
tests' interpreter too, so the host counts a timeout and reloads both; after `max_timeouts`
timeouts the rest are not run and fail. (What the submission prints goes to /dev/null: a print
loop is a busy loop.)
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from agent_rl.core.renderers.toolcalls import parse_bare_calls
from agent_rl.tools.sandbox import Backend

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_TOOL_CALL = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)
REPLY_CAP = 8 << 20  # bytes of one encoded return value

# Built-in values as tagged JSON, loaded into both processes. Exact types only: a subclass of str
# or float with its own __eq__ is refused like any other object.
CODEC = r'''
_ATOMS = (type(None), bool, str)
_SEQS = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}

def plain_encode(x):
    t = type(x)
    if t in _ATOMS:
        return x
    if t is int:
        return {"int": hex(x)}
    if t is float:
        return {"float": x.hex()}
    if t is complex:
        return {"complex": [x.real.hex(), x.imag.hex()]}
    if t is bytes:
        return {"bytes": x.hex()}
    if t.__name__ in _SEQS and _SEQS[t.__name__] is t:
        return {t.__name__: [plain_encode(v) for v in x]}
    if t is dict:
        return {"dict": [[plain_encode(k), plain_encode(v)] for k, v in x.items()]}
    raise TypeError(f"only built-in values count, not a {t.__name__}")

def plain_decode(x):
    if type(x) in _ATOMS:
        return x
    [(kind, v)] = x.items()
    if kind == "int":
        return int(v, 16)
    if kind == "float":
        return float.fromhex(v)
    if kind == "complex":
        return complex(float.fromhex(v[0]), float.fromhex(v[1]))
    if kind == "bytes":
        return bytes.fromhex(v)
    if kind in _SEQS:
        return _SEQS[kind](plain_decode(i) for i in v)
    if kind == "dict":
        return {plain_decode(k): plain_decode(i) for k, i in v}
    raise ValueError(f"unknown value kind {kind!r}")
'''

# The submission's process: fed length-prefixed JSON requests on stdin, one JSON line back per
# request on a private copy of stdout; its own stdin, stdout and stderr are /dev/null.
CANDIDATE = CODEC + r'''
import dis, json, os, resource, sys
_requests, _replies = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "w")
_null = os.open(os.devnull, os.O_RDWR)
for _fd in (0, 1, 2):
    os.dup2(_null, _fd)
_cpu = int(sys.argv[1])

def _does_nothing(fn):
    """The prompt's stub, `pass` or `return None`: a body that only returns None."""
    try:
        ops = [(i.opname, i.argval) for i in dis.get_instructions(fn) if i.opname not in ("RESUME", "NOP", "CACHE")]
    except TypeError:
        return False
    return ops in ([("LOAD_CONST", None), ("RETURN_VALUE", None)], [("RETURN_CONST", None)])

def _load(prompt, submission, entry_point):
    ns = {"__name__": "__main__"}
    code = [line for line in submission.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if code and code[0][0] in " \t":  # only the function's body: it completes the prompt's def
        exec(compile(prompt + "\n" + submission, "<submission>", "exec"), ns)
    else:
        exec(compile(prompt, "<prompt>", "exec"), ns)
        exec(compile(submission, "<submission>", "exec"), ns)
    fn = ns.get(entry_point)
    if not callable(fn) or _does_nothing(fn):
        raise NameError(f"the submission does not implement {entry_point}")
    return fn

_fn = None
while True:
    _size = _requests.readline()
    if not _size:
        break
    _request = json.loads(_requests.read(int(_size)))
    _used = resource.getrusage(resource.RUSAGE_SELF)
    resource.setrlimit(resource.RLIMIT_CPU, (int(_used.ru_utime + _used.ru_stime) + 1 + _cpu, resource.RLIM_INFINITY))
    try:
        if "load" in _request:
            _fn, _out = _load(*_request["load"]), None
        else:
            _out = _fn(*plain_decode(_request["args"]), **plain_decode(_request["kwargs"]))
        _reply = json.dumps({"ok": plain_encode(_out)})
    except BaseException as e:
        _reply = json.dumps({"error": type(e).__name__, "message": str(e)[:300]})
    _replies.write(_reply + "\n")
    _replies.flush()
'''

# Loaded into the tests' interpreter after the prompt and the test preamble (again after a restart);
# its names start with __grade_ to stay clear of the tests'. Sets __grade_ns (where tests run) and
# __grade_start (start the submission's process; raises when the program does not load).
HARNESS = r'''
def __grade_make(prompt, submission, entry_point, cpu_s, reply_cap):
    import ctypes, json, os, signal, subprocess, sys, traceback  # all imports before the child exists
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: the child may not trace or read us
    sys.path[:] = [p for p in sys.path if p and os.path.isabs(p) and not p.startswith("/tmp")]
    codec = {}
    exec(CODEC, codec)
    state = {"proc": None}

    def ask(request):
        proc, data = state["proc"], json.dumps(request).encode()
        try:
            proc.stdin.write(b"%d\n" % len(data) + data)
            proc.stdin.flush()
            line = proc.stdout.readline(reply_cap)
        except OSError:
            line = b""
        if not line.endswith(b"\n"):  # it died, or flooded its reply channel
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            status, state["proc"] = proc.wait(), None
            if status == -signal.SIGXCPU:
                os._exit(128 + signal.SIGXCPU)  # out of CPU time: a timeout, reported as the driver does
            raise AssertionError("the submission's process died")
        reply = json.loads(line)
        if "ok" not in reply:
            raise AssertionError(f"the submission raised {reply['error']}: {reply.get('message', '')}")
        return codec["plain_decode"](reply["ok"])

    def start():
        state["proc"] = subprocess.Popen(
            [sys.executable, "-E", "-s", "-c", CANDIDATE, str(cpu_s)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        ask({"load": [prompt, submission, entry_point]})

    def candidate(*args, **kwargs):
        if state["proc"] is None:
            start()
        encode = codec["plain_encode"]
        return ask({"args": encode(list(args)), "kwargs": encode(kwargs)})

    return start, candidate

def __grade_run(source):
    try:
        exec(source, __grade_ns)
    except BaseException:
        raise AssertionError("hidden test failed") from None
'''


def extract_code(text: str) -> str | None:
    """The last fenced code block (```python, ```py or bare ```) outside tool calls, or None (also for a
    reply of bare JSON calls, `core.renderers.toolcalls.parse_bare_calls`: a call, not a submission)."""
    if parse_bare_calls(text):
        return None
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

    compiled: bool  # the program loaded and defined the entry point
    statuses: tuple[str, ...]  # per test: "ok", a sandbox status (error, timeout, ...) or "not_run"

    @property
    def passed(self) -> int:
        return self.statuses.count("ok")

    @property
    def share(self) -> float:
        return self.passed / len(self.statuses)


def harness_source(prompt: str, submission: str, entry_point: str, cpu_s: int) -> str:
    """The tests' side of the harness for one submission (strings passed as Python literals)."""
    return (f"CODEC = {CODEC!r}\nCANDIDATE = {CANDIDATE!r}\n{HARNESS}\n"
            f"__grade_start, candidate = __grade_make({prompt!r}, {submission!r}, {entry_point!r}, {cpu_s}, "
            f"{REPLY_CAP})\n"
            f"__grade_ns = dict(globals())\n__grade_ns[{entry_point!r}] = candidate\n")


@dataclass(frozen=True)
class CheckOutcome:
    """One test as the agent may see it (visible tests): its status and, when it failed, why."""

    source: str
    status: str  # as TestReport.statuses
    detail: str = ""  # "returned 3", "raised ZeroDivisionError: division by zero", "timed out", ...


async def run_hidden_tests(backend: Backend, prompt: str, submission: str, entry_point: str, test_source: str,
                           max_timeouts: int = 2) -> TestReport:
    """Run `check`'s tests against `entry_point` of the submission (completing `prompt`), each call
    within `backend.limits` (cpu_s bounds a busy loop whatever the machine's load; wall_s one that sleeps)."""
    report, _ = await run_tests(backend, prompt, submission, entry_point, test_source, max_timeouts)
    return report


def _first_call(source: str, arg: str = "candidate") -> str | None:
    """The first `candidate(...)` call of a test statement, as source: what to show the agent it returned."""
    calls = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == arg]
    return ast.unparse(calls[0]) if calls else None


async def _explain(session, result, source: str) -> str:
    """Why a test failed, for the agent's eyes: what its first call returned or raised."""
    if result.status == "timeout":
        return "timed out (over its CPU or wall-clock limit)"
    if result.state_lost:
        return f"crashed the tests' interpreter ({result.status})"
    call = _first_call(source)
    if result.status != "error" or call is None:
        return _last_line(result.stderr) if result.status == "error" else result.status
    got = await session.run(f"print(repr({call})[:300])")
    if got.status == "ok":
        return f"returned {got.stdout.strip()}"
    why = _last_line(got.stderr)
    return why if why.startswith("crashed") else f"raised {why}"


def _last_line(stderr: str) -> str:
    """The error a traceback ends on, as the agent reads it (the harness's own wrapping taken off)."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    line = lines[-1][:300] if lines else "failed"
    return line.replace("AssertionError: the submission raised ", "").replace(
        "AssertionError: the submission's process died", "crashed (its process died)")


async def run_tests(backend: Backend, prompt: str, submission: str, entry_point: str, test_source: str,
                    max_timeouts: int = 2, explain: bool = False) -> tuple[TestReport, list[CheckOutcome]]:
    """`run_hidden_tests`, and with `explain` each test's outcome with why it failed (for visible tests:
    never for hidden ones, whose sources the agent must not see). Not compiling is one outcome whose
    detail is the load error."""
    preamble, steps = split_check(test_source)
    harness = harness_source(prompt, submission, entry_point, backend.limits.cpu_s)
    n_tests = sum(s.is_test for s in steps)
    statuses: list[str] = []
    outcomes: list[CheckOutcome] = []
    async with backend.session() as session:

        async def load(setup: list[str]) -> bool:
            for source in (prompt + "\n" + preamble, harness, "__grade_start()"):
                result = await session.run(source)
                if result.status != "ok":
                    if explain:
                        outcomes.append(CheckOutcome("load", result.status, _last_line(result.stderr)))
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
                if explain:
                    why = "" if result.status == "ok" else await _explain(session, result, step.source)
                    outcomes.append(CheckOutcome(step.source, result.status, why))
            else:
                setup_done.append(step.source)
    statuses += ["not_run"] * (n_tests - len(statuses))
    return TestReport(compiled, tuple(statuses)), outcomes
