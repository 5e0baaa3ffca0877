"""Format checks as TRL-style reward functions: 1.0 when a completion is well formed, else 0.0.

Owns: checks of a completion's shape that catch format tricks: `single_answer` (the final reply
holds exactly one answer, not a hedge over several numbers), `no_tool_markup` (no tool-call or
forged tool-response markup left in the final reply), `tags_closed` (no unclosed or stray
<answer>, <tool_call>, <tool_response> or <think> tags in any assistant turn), and `used_tools`
(the episode called a tool at all). Each is `fn(completions, **kwargs) -> list[float]` (see
`rewards.rubric`); give them weight 0 to log them as metrics, or a weight to shape the reward.
Does not own: whether the answer is right (`rewards.answers`) or how checks are weighted (`rewards.rubric`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from agent_rl.rewards.answers import answer_span, is_number_list
from agent_rl.rewards.rubric import Messages, final_reply

TAGS = ("answer", "tool_call", "tool_response", "think")
_TAG = re.compile(r"<(/?)(" + "|".join(TAGS) + r")>")
_MARKUP = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def _assistant_texts(completion: str | Messages) -> list[str]:
    if isinstance(completion, str):
        return [completion]
    return [str(m.get("content") or "") for m in completion if m.get("role") == "assistant"]


def tags_balanced(text: str) -> bool:
    """Every known tag opens before it closes, is closed, and is not nested in itself."""
    open_tags: set[str] = set()
    for m in _TAG.finditer(text):
        closing, name = m.group(1) == "/", m.group(2)
        if closing != (name in open_tags):  # a stray closing tag, or an opening one while open
            return False
        if closing:
            open_tags.remove(name)
        else:
            open_tags.add(name)
    return not open_tags


def single_answer(completions: Sequence[str | Messages], **kwargs: Any) -> list[float]:
    """1.0 when the final reply holds exactly one answer: at most one <answer> and one \\boxed{},
    and the answer is one value, not a list ("82, 83, 84")."""
    scores = []
    for completion in completions:
        text = final_reply(completion)
        span = answer_span(text)
        one = span is not None and not is_number_list(span)
        scores.append(float(one and text.count("<answer>") <= 1 and text.count("\\boxed{") <= 1))
    return scores


def no_tool_markup(completions: Sequence[str | Messages], **kwargs: Any) -> list[float]:
    """1.0 when the final reply holds no tool-call or tool-response markup (no call left unanswered,
    no forged tool output)."""
    return [float(not any(tag in final_reply(c) for tag in _MARKUP)) for c in completions]


def tags_closed(completions: Sequence[str | Messages], **kwargs: Any) -> list[float]:
    """1.0 when every assistant turn has its <answer>, <tool_call>, <tool_response>, <think> tags balanced."""
    return [float(all(tags_balanced(t) for t in _assistant_texts(c))) for c in completions]


def used_tools(completions: Sequence[str | Messages], **kwargs: Any) -> list[float]:
    """1.0 when the completion holds a tool message (some tool call was made), else 0.0."""
    return [float(not isinstance(c, str) and any(m.get("role") == "tool" for m in c)) for c in completions]
