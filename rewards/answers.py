"""Final-answer rewards: extract the model's one final answer and compare it with the reference.

Owns: a plain last-number check (`final_number`, `numeric_answer`); final-answer extraction with its
guards against hedged answers (`answer_span`, `is_number_list`); for a numeric reference, the value
the answer states (`stated_value`, `rational`: 0.5 = 1/2 = \\frac{1}{2}, compared exactly); for any
other reference, equivalence through math-verify (LaTeX, \\sqrt{18} = 3\\sqrt{2}) in a worker process
with a hard deadline (`math_equal`, `math_equal_async`); `math_answer` and the TRL-style reward
`correct_answer`, which use both.
Does not own: running code (`rewards.code`), format checks (`rewards.format`), weighting (`rewards.rubric`).

Extraction takes exactly ONE candidate from the final reply, in this order: the <answer>...</answer>
(several such tags state no one answer), else the last \\boxed{...}, else the last line holding a
digit (math-verify then reads that line: "the answer is 84", $\\frac{1}{2}$, or its last number). A
reply that still holds tool-call markup is a tool call, not an answer, and so is a reply of bare
JSON calls (`{"name": "calculator", "arguments": {"expression": "27"}}`,
`core.renderers.toolcalls.parse_bare_calls`), whether or not the renderer read it as a call. Guard against
hedging: a candidate whose last number ends a list of numbers ("82, 83, 84", "84 or 85", "$84$ $85$")
is no answer at all unless the reference is itself a list, so a reply cannot spread its bets over
several numbers; and only the one candidate is ever compared, never "any number in the text".

When the reference is a number (84, 0.5, 1/2, \\frac{1}{2}), the candidate must state it: its last
number, written in ASCII digits, or its last fraction of two whole numbers in lowest terms, is
compared by exact value, and that number may not be an operand of arithmetic. So "(123 + 456) * 7"
(the question copied), "4000 + 53", "2^{12}", "91/7" or "\\sqrt{16}" earn nothing whatever they
evaluate to: a grader that evaluates expressions rewards restating the question instead of
solving it. Look-alike digits ("８４", "٨٤") are no answer either: they read as a number to Python
but not to what consumes the answer. math-verify judges the other references (\\sqrt{18}, lists).

Why a worker process: math-verify's own timeouts use SIGALRM, which works only in the main thread
(our rewards run on the event loop, and TRL users call them from threads too) and cannot interrupt
a long C-level call such as sympy evaluating 10^{10^{10}}. The worker runs math-verify with its
timeouts off (`parsing_timeout=None`, `timeout_seconds=None`); the caller waits at most `timeout_s`
and past that kills the worker (a fresh one starts on the next call) and scores "not equal".
"""

from __future__ import annotations

import asyncio
import atexit
import importlib.util
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from typing import Any

from agent_rl.core.renderers.toolcalls import parse_bare_calls
from agent_rl.rewards.rubric import Messages, final_reply

log = logging.getLogger(__name__)

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def final_number(text: str) -> float | None:
    """The number the text ends on: inside <answer>...</answer> if present, else the last number."""
    tagged = _ANSWER_TAG.findall(text)
    scope = tagged[-1] if tagged else re.sub(r"<tool_call>.*?</tool_call>", " ", text, flags=re.DOTALL)
    found = _NUMBER.findall(scope)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def numeric_answer(completion: str, answer: float | int | str, rel_tol: float = 1e-6) -> float:
    """1.0 when the reply's one final answer is a number within `rel_tol` of `answer`, else 0.0. The
    answer is found as `correct_answer` finds it: one final answer (a list of candidates, several
    tagged answers or a hedge earn nothing), in ASCII digits, not an operand of arithmetic."""
    span = _candidate(completion, str(answer))
    value = stated_value(span) if span is not None else None
    if value is None:
        return 0.0
    want = float(str(answer).replace(",", ""))
    return 1.0 if abs(float(value) - want) <= rel_tol * max(1.0, abs(want)) else 0.0


# -- extraction ------------------------------------------------------------------------------------
# a number: thousands groups ("1,234") or plain digits, optional decimals; "84,85" is two numbers
_NUM = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_PLAIN = re.compile(r"\s*" + _NUM.pattern + r"\s*")
# what may stand between the items of a list: spaces, commas, "or"/"and", LaTeX spacing, $ and &
_LIST_SEP = re.compile(r"(?:\s|[,;$&]|\\[,;:! ]|\\q?quad\b|\\text\{\s*(?:or|and)\s*\}|\b(?:or|and)\b)+", re.I)
_UNIT_WORDS = re.compile(r"(?:\s+[A-Za-z]+\.?)+$")  # "84 dollars": LaTeX would read d*o*l*l*a*r*s
_MAX_LINE = 300  # longest tagged answer; of a free-text answer line math-verify reads the end


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} with balanced braces, or None."""
    start = text.rfind("\\boxed{")
    while start >= 0:
        depth, i = 1, start + len("\\boxed{")
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len("\\boxed{"): i - 1]
        start = text.rfind("\\boxed{", 0, start)
    return None


def answer_span(text: str) -> str | None:
    """The one final-answer candidate of a reply, as math-verify should read it, or None.

    A tagged or boxed answer comes back as one LaTeX expression, $...$ (trailing words such as
    units dropped), or as a plain number; a free-text line comes back as it is (math-verify finds
    the answer in it).
    """
    tagged = _ANSWER_TAG.findall(text)
    if "<tool_call>" in text or "</tool_call>" in text or parse_bare_calls(text) or len(tagged) > 1:
        return None
    span = tagged[-1] if tagged else _last_boxed(text)
    if span is not None:
        if len(span) > _MAX_LINE:  # an essay in the answer tag is not an answer
            return None
        span = _UNIT_WORDS.sub("", span.strip().rstrip(".")).strip()
        return (span if _PLAIN.fullmatch(span) else f"${span}$") if span else None
    lines = [line.strip() for line in text.splitlines() if re.search(r"\d", line)]
    if not lines:
        return None
    line = lines[-1]
    if len(line) > _MAX_LINE:  # keep the end, cut at a space so no number is split
        tail = line[-_MAX_LINE:]
        line = tail[tail.find(" ") + 1:] if " " in tail else tail
    return line


def is_number_list(span: str) -> bool:
    """True when the span's last number ends a list of numbers: "1, 2, 3", "84 or 85", "$4$ $5$"."""
    found = list(_NUM.finditer(span))
    if len(found) < 2:
        return False
    between = span[found[-2].end():found[-1].start()]
    return bool(between) and _LIST_SEP.fullmatch(between) is not None


# -- equivalence: math-verify in a worker process -------------------------------------------------
_WORKER = r"""
import ctypes, json, logging, os, resource, sys
try:  # die with the parent (Linux), even in the middle of a long C-level call that holds the GIL
    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
except AttributeError:
    pass
if os.getppid() != int(sys.argv[1]):  # the parent died before that took effect
    sys.exit(0)
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # a runaway sympy number fails, not the host
replies = os.fdopen(os.dup(1), "w")
sys.stdout = sys.stderr  # a stray print must not corrupt the replies
logging.disable(logging.CRITICAL)
from math_verify import parse, verify
replies.write("ready\n"); replies.flush()
for line in sys.stdin:
    request = json.loads(line)
    try:
        gold = parse(request["gold"], parsing_timeout=None)
        pred = parse(request["pred"], parsing_timeout=None)
        reply = {"equal": bool(gold and pred and verify(gold, pred, timeout_seconds=None))}
    except Exception as e:
        reply = {"error": f"{type(e).__name__}: {e}"}
    replies.write(json.dumps(reply) + "\n"); replies.flush()
"""
_START_TIMEOUT_S = 60.0  # importing sympy on a busy 2-core machine


class _Verifier:
    """The math-verify worker: started on first use; past a deadline killed, and restarted next call.

    It dies with its parent, or more exactly with the thread that started it (PR_SET_PDEATHSIG): a
    worker started from a short-lived thread is replaced by the next call.
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._buffer = b""
        self._lock = threading.Lock()

    def equal(self, pred: str, gold: str, timeout_s: float) -> bool:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            assert self._proc is not None and self._proc.stdin is not None
            try:
                self._proc.stdin.write((json.dumps({"pred": pred, "gold": gold}) + "\n").encode())
                self._proc.stdin.flush()
                line = self._readline(timeout_s)
            except OSError:
                line = None
            if line is None:
                self.stop()
                log.warning("math-verify gave no verdict within %g s on %r vs %r: counted as not equal",
                            timeout_s, pred[:80], gold[:80])
                return False
            reply = json.loads(line)
            if "error" in reply:
                log.warning("math-verify failed on %r vs %r: %s", pred[:80], gold[:80], reply["error"])
            return bool(reply.get("equal"))

    def _start(self) -> None:
        if importlib.util.find_spec("math_verify") is None:
            raise RuntimeError("math-verify is not installed (pip install math-verify)")
        self.stop()
        self._proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(os.getpid())], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        if self._readline(_START_TIMEOUT_S) != b"ready":
            status = self._proc.poll()
            self.stop()
            raise RuntimeError(f"the math-verify worker did not start within {_START_TIMEOUT_S:g} s" if status is None
                               else f"the math-verify worker exited with status {status} while starting")

    def _readline(self, timeout_s: float) -> bytes | None:
        """The worker's next reply line; None past the deadline or when it died."""
        assert self._proc is not None and self._proc.stdout is not None
        fd, deadline = self._proc.stdout.fileno(), time.monotonic() + timeout_s
        poller = select.poll()  # not select(): a busy trainer may hold more than 1024 descriptors
        poller.register(fd, select.POLLIN)
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def stop(self) -> None:
        proc, self._proc, self._buffer = self._proc, None, b""
        if proc is not None:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()


_verifier = _Verifier()
atexit.register(_verifier.stop)
# one thread: the worker answers one call at a time anyway, and the loop's default executor stays free
_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="math-verify")


def math_equal(prediction: str, gold: str, timeout_s: float = 5.0) -> bool:
    """Does the answer `prediction` (an `answer_span`) equal the reference `gold` mathematically?

    Safe from any thread; returns within `timeout_s` of the worker being up ("not equal" past it).
    Two plain numbers are compared exactly here ("84.0" == "84"), without the worker.
    """
    if _PLAIN.fullmatch(prediction) and _PLAIN.fullmatch(gold):
        return Fraction(prediction.strip().replace(",", "")) == Fraction(gold.strip().replace(",", ""))
    return _verifier.equal(prediction, f"$\\boxed{{{gold}}}$", timeout_s)


async def math_equal_async(prediction: str, gold: str, timeout_s: float = 5.0) -> bool:
    """`math_equal` without blocking the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_executor, math_equal, prediction, gold, timeout_s)


# -- numeric references: the value the reply states ----------------------------------------------
# the literals a number can be stated as, one group per part: \frac{a}{b}, \dfrac12, a/b, a number
_LITERAL = re.compile(r"(-?)\s*\\[dt]?frac\s*\{\s*(\d+)\s*\}\s*\{\s*(\d+)\s*\}"
                      r"|(-?)\s*\\[dt]?frac\s*(\d)(\d)(?!\d)"
                      r"|(?<![\w.])(-?)(\d+)\s*/\s*(\d+)(?![\d.])"
                      r"|(?<![\w.])(-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?)", re.ASCII)
_OPERATOR_BEFORE = re.compile(r"(?:[-+*/×·÷^_]|\\(?:times|cdot|div|pm|mp))\s*$")
_FUNCTION_BEFORE = re.compile(r"(?:\\(?:sqrt|[dt]?frac|log|ln|exp|binom|sin|cos|tan)(?:\[[^\]]*\])?|\^|_)$")
_OPERATOR_AFTER = re.compile(r"^\s*(?:[*/×·÷^_]|\\(?:times|cdot|div|pm|mp))")  # not - + !: prose uses them
_OPERAND_END = re.compile(r"[\w)\]}|]$")
_WRAPPERS = " \t{}()$"


def rational(text: str) -> Fraction | None:
    """The value of a number or a fraction literal ("84", "-0.5", "1,234", "1/2", "\\frac{1}{2}"), else None."""
    m = _LITERAL.fullmatch(text.strip().strip("$").strip())
    return None if m is None else _literal_value(m)


def _literal_value(m: re.Match[str]) -> Fraction | None:
    """A `_LITERAL` match's value; None for a fraction not in lowest terms (91/7, 2/4, 84/1)."""
    if m.group(10) is not None:
        return Fraction(m.group(10).replace(",", ""))
    sign, numerator, denominator = next((m.group(i), m.group(i + 1), m.group(i + 2)) for i in (1, 4, 7)
                                        if m.group(i + 1) is not None)
    value = Fraction(int(numerator), max(int(denominator), 1))
    if int(denominator) < 2 or value.denominator != int(denominator):
        return None
    return -value if sign else value


def _is_operand(before: str, after: str) -> bool:
    """Whether a literal with `before` and `after` around it takes part in arithmetic."""
    before = before.rstrip(_WRAPPERS)
    if (op := _OPERATOR_BEFORE.search(before)) and _OPERAND_END.search(before[:op.start()].rstrip(_WRAPPERS)):
        return True  # a binary operator with something before it: "4000 + 53", "(a + b) * 7", "5 -84"
    if _FUNCTION_BEFORE.search(before):
        return True  # a function's argument or an exponent: "\sqrt{16}", "2^{12}"
    return bool(_OPERATOR_AFTER.match(after.lstrip("})")))


def stated_value(span: str) -> Fraction | None:
    """The number an answer span states last, as a literal (a number, or a fraction in lowest terms);
    None when that literal is an operand of arithmetic or the span holds look-alike digits."""
    if any(c.isdecimal() and not c.isascii() for c in span):
        return None
    found = list(_LITERAL.finditer(span))
    if not found:
        return None
    last, before = found[-1], span[:found[-1].start()]
    if last.group().lstrip().startswith("-") and re.search(r"[\d)\]}]$", before.rstrip(_WRAPPERS)):
        return None  # "5 -84": a subtraction, not -84
    return None if _is_operand(before, span[last.end():]) else _literal_value(last)


def _candidate(text: str, gold: str) -> str | None:
    span = answer_span(text)
    if span is None or (is_number_list(span) and not is_number_list(gold)):
        return None
    return span


def math_answer(text: str, gold: Any, timeout_s: float = 5.0) -> float:
    """1.0 when the reply's one final answer equals `gold` (math-verify), else 0.0."""
    span, want = _candidate(text, str(gold)), rational(str(gold))
    if span is None or want is not None:
        return float(span is not None and stated_value(span) == want)
    return float(math_equal(span, str(gold), timeout_s))


async def correct_answer(completions: Sequence[str | Messages], answer: Sequence[Any], **kwargs: Any) -> list[float]:
    """TRL-style reward: 1.0 where the completion's final answer equals the `answer` column, else 0.0."""
    scores = []
    for completion, gold in zip(completions, answer, strict=True):
        span, want = _candidate(final_reply(completion), str(gold)), rational(str(gold))
        if span is None or want is not None:
            scores.append(float(span is not None and stated_value(span) == want))
        else:
            scores.append(float(await math_equal_async(span, str(gold))))
    return scores
