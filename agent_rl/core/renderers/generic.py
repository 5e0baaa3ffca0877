"""The generic fallback: any tokenizer with a chat template, rendered by the template itself.

Owns: `GenericRenderer`, for models no family renderer knows. Every prompt is the tokenizer's own
`apply_chat_template` of the whole conversation (tool schemas passed as `tools`); after each sampled
turn the new render is compared with the token buffer: when it extends the buffer, only the new ids
are appended (one append-only sequence, as with the family renderers); when it does not (the template
rewrote an earlier turn, or the model sampled a non-canonical tokenisation), the episode goes on in a
new training segment whose context is the fresh render (`core.types.Segment`), so nothing sampled is
ever re-tokenised and nothing fails.
Does not own: family formats (`core.renderers.chatml`, ...), picking this renderer (`core.renderers.choose`, which
prints the one-line notice).

What it has to guess: tool calls are parsed in the Hermes `<tool_call>{json}</tool_call>` form (the
most common one among templates with tools) and written that way for demonstrations; the end of a
turn is the token the template writes right after an assistant message's text (else the
tokenizer's eos). A sampled assistant turn is passed back to the template as plain `content`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agent_rl.core.renderers.base import Renderer
from agent_rl.core.renderers.chatml import format_tool_call
from agent_rl.core.renderers.toolcalls import parse_tool_calls
from agent_rl.core.types import Message, ToolCall

_PROBE = "Zq7 probe reply"


class GenericRenderer(Renderer):
    """Renders with the tokenizer's chat template, checking the prefix at every turn."""

    name = "generic"

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("tokenizer has no chat template: the generic renderer renders with it")
        self._stop = self._find_stop_ids()

    def _template(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] = (),
                  add_generation_prompt: bool = True, tokenize: bool = True) -> Any:
        out = self.tokenizer.apply_chat_template(
            list(messages), tools=list(tools) or None, tokenize=tokenize, add_generation_prompt=add_generation_prompt,
            return_dict=False)
        return list(out) if tokenize else out

    def _find_stop_ids(self) -> list[int]:
        """The token the template writes right after an assistant's text, and eos."""
        stops: list[int] = []
        try:
            text = self._template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}],
                                  add_generation_prompt=False, tokenize=False)
            after = text.split(_PROBE, 1)[1]
            special = set(self.tokenizer.all_special_ids) | set(getattr(self.tokenizer, "added_tokens_decoder", {}))
            first = self.tokenizer.encode(after, add_special_tokens=False)[:1]
            if first and first[0] in special:
                stops.append(int(first[0]))
        except Exception:  # a template that cannot render this probe: fall back on eos
            pass
        eos = self.tokenizer.eos_token_id
        if eos is not None and eos not in stops:
            stops.append(int(eos))
        if not stops:
            raise ValueError("cannot tell how a turn ends: the chat template writes no special token after a reply "
                             "and the tokenizer has no eos token")
        return stops

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self._stop)

    @staticmethod
    def as_dicts(messages: Sequence[Message]) -> list[dict[str, Any]]:
        out = []
        for m in messages:
            d: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.role == "tool" and m.name:
                d["name"] = m.name
            out.append(d)
        return out

    def render(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] = (),
               add_generation_prompt: bool = True) -> list[int]:
        return self._template(self.as_dicts(messages), tools, add_generation_prompt)

    def continuation(self, messages: Sequence[Message], after_stop: bool = True) -> list[int]:
        raise NotImplementedError("the generic renderer needs the whole conversation: use next_context")

    def next_context(self, conversation: Sequence[Message], new_messages: Sequence[Message],
                     tools: Sequence[dict[str, Any]], buffer_ids: Sequence[int],
                     after_stop: bool = True) -> tuple[list[int], bool]:
        return self.extend_or_restart(conversation, tools, buffer_ids)

    def parse_tool_calls(self, text: str) -> list[ToolCall]:
        return parse_tool_calls(text)

    def format_reply(self, content: str, tool_calls: Sequence[ToolCall] = ()) -> str:
        calls = "\n".join(format_tool_call(c.name, c.arguments) for c in tool_calls)
        return "\n".join(part for part in (content, calls) if part)
