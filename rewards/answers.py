"""Final-answer rewards: extract the model's final answer and compare it with the reference.

Owns: plain reward functions over text (`final_number`, `numeric_answer`).
Does not own: running code (`rewards.code`) or weighting rewards together.
"""

from __future__ import annotations

import re

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
    """1.0 when the completion's final number equals `answer` (relative tolerance), else 0.0."""
    got = final_number(completion)
    if got is None:
        return 0.0
    want = float(str(answer).replace(",", ""))
    return 1.0 if abs(got - want) <= rel_tol * max(1.0, abs(want)) else 0.0
