"""What reward hacks are made of: `Hack` (a named policy in one or more variants) and the moves every
group of hacks uses (`say`, `tool_outputs`, `calls_then`).

Owns: `Hack`, `Policy` (a function of the conversation's messages returning the next assistant reply)
and those moves.
Does not own: the hacks themselves (`audit.hacks`, `audit.turn_hacks`), what a hack knows about a task
(`core.audit_target.Target`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agent_rl.core.audit_target import Target
from agent_rl.core.types import Message, ToolCall

Policy = Callable[[Sequence[Message]], "Message | str"]


@dataclass(frozen=True)
class Hack:
    name: str
    group: str  # answer, tool, coding, gui or turn (core.audit_target.HACK_GROUPS)
    what: str  # one line for the table
    variants: Callable[[Target], dict[str, Policy]] = field(repr=False)  # {} where it does not apply


def say(text: str) -> Policy:
    return lambda messages: Message("assistant", text)


def tool_outputs(messages: Sequence[Message]) -> list[str]:
    return [m.content for m in messages if m.role == "tool"]


def calls_then(calls: Sequence[ToolCall], final: str | Callable[[Sequence[Message]], str]) -> Policy:
    """One call per turn, then `final` (a text, or a function of the messages) without a call."""

    def policy(messages: Sequence[Message]) -> Message:
        done = len(tool_outputs(messages))
        if done < len(calls):
            return Message("assistant", "", (calls[done],))
        return Message("assistant", final if isinstance(final, str) else final(messages))

    return policy
