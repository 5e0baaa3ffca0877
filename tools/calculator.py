"""The calculator tool: arithmetic on model-written expressions, with every result bounded in size.

Owns: `calculator` (a safe evaluator over Python's `ast`, no eval) and its limits. Does not own: the
calculator environment (`envs.calculator`), or how a tool call runs (`tools.base`, `tools.runners`).

Why results are bounded before they are computed: Python's big-int `**` and `*` hold the GIL, so a
23-character expression such as `(((9**64)**64)**64)**64` used to keep a core busy for many seconds
(docs/performance.md#smaller-measurements) and freeze the event loop (every other rollout of the step)
with it; one level deeper is hours. A cap on the exponent alone does not help, because nesting
multiplies the exponents. So every operation first estimates the size of its result from the sizes of
its operands and refuses one over `MAX_DIGITS` with a `ToolError`; every operand is then itself within
the limit, so each operation costs at most a product of two 3,322-bit integers (microseconds), and a
200-character expression holds at most ~100 operations. Floats are C doubles: an overflow or a
non-finite value is refused, as is a complex result (a negative number to a fractional power). The tool
also runs in a worker process (`tool_options(isolate=True)`), so a case this bound missed would cost its
deadline, not the run.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

from agent_rl.tools.base import ToolError, tool_options

MAX_CHARS = 200
MAX_DIGITS = 1000  # of an integer result
LIMIT = 10**MAX_DIGITS  # the smallest integer with too many digits
MAX_BITS = LIMIT.bit_length()  # 3,322: a result of more bits is surely over the limit
_OPS: dict[type, Callable] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.USub: operator.neg, ast.UAdd: operator.pos}
TOO_LARGE = f"result too large (limit {MAX_DIGITS} digits)"


def _estimated_bits(op: ast.operator, left: int | float, right: int | float) -> float:
    """A lower bound on the bit length of `left op right` for integers (0 where it is small anyway)."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return 0.0  # a float result: a C double, checked for overflow after the fact
    if isinstance(op, ast.Mult) and left and right:
        return left.bit_length() + right.bit_length() - 1
    if isinstance(op, ast.Pow) and right > 0 and abs(left) > 1:
        if right.bit_length() > 32:  # 2**(2**32) and up: no float needed to see it is too large
            return math.inf
        return right * math.log2(abs(left))  # |left| ** right = 2 ** (right * log2|left|)
    return 0.0


def _checked(value: int | float | complex) -> int | float:
    if isinstance(value, complex):
        raise ToolError("the result is not a real number")
    if isinstance(value, int) and abs(value) >= LIMIT:
        raise ToolError(TOO_LARGE)
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("the result is not a finite number (overflow)")
    return value


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _checked(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if _estimated_bits(node.op, left, right) > MAX_BITS:
            raise ToolError(TOO_LARGE)
        return _checked(_OPS[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ToolError(f"unsupported expression element {type(node).__name__}: use numbers and + - * / // % ** ( )")


@tool_options(isolate=True, timeout_s=5.0)
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Arithmetic using numbers, + - * / // % ** and parentheses, e.g. "(3 + 4) * 12".
    """
    if len(expression) > MAX_CHARS:
        raise ToolError(f"expression too long (limit {MAX_CHARS} characters)")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise ToolError(f"cannot parse {expression!r} as arithmetic") from None
    try:
        value = _eval(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except OverflowError:  # a float operation, or an integer too large to become a float
        raise ToolError("overflow: a number too large for floating point") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)
