"""The chat-format interface: one renderer per model family renders *and* parses.

Owns: `Renderer`, the base every family's renderer implements (render a conversation with tool
schemas; the token delta appended after a sampled turn; parse sampled ids into an assistant
`Message` with its tool calls and parse errors; stop tokens; how a reply with tool calls is
written), the tokenizer plumbing they share (`encode` splits special-token strings, so text can
never forge a turn boundary; `encode_cached` tokenises a repeated text once while it is recent; both go
straight to a fast tokenizer's Rust backend when that gives the same ids; `decode_raw` reads a byte-level
tokenizer's ids through a table of their bytes, `core.renderers.bytelevel`).
Does not own: a family's format (`core.renderers.chatml`, ...), choosing the family (`core.renderers.choose`),
deciding what the messages are (`envs`), sampling, or the token buffer of an episode
(`rollout.runner`).

The contract the runner relies on: after a sampled assistant turn, `next_context` says what enters
the token buffer; for a family written here it is `continuation(messages)`, appended, and for
canonically tokenised replies, initial prompt + samples + continuations == `render(all messages)`
(each family's tests check it). The sampled ids themselves are never re-rendered. A format that
cannot promise this (the generic fallback on a template that rewrites history) answers instead with
a fresh context that starts a new training segment (`core.types.Segment`): `extend_or_restart`, the one
place that decides between the two for a whole render.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from agent_rl.core.renderers.bytelevel import byte_table
from agent_rl.core.types import Message, ToolCall


class Renderer(abc.ABC):
    """Renders conversations to token ids and parses sampled ids back into messages."""

    name: str = ""
    bare_calls: bool | None = None  # reading tag-less JSON calls: None where the family has no such switch
    cache_ids = 1_000_000  # ids `encode_cached` keeps (~40 MB at most), the texts used least recently dropped first

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._encoded: OrderedDict[str, list[int]] = OrderedDict()  # encode_cached's texts, least recently used first
        self._encoded_ids = 0  # ids held in `_encoded`

    # -- tokens ----------------------------------------------------------------------------------
    def special_id(self, token: str) -> int:
        """The id of a special token, or ValueError naming the token this format needs."""
        ids = self.tokenizer.convert_tokens_to_ids([token])
        if not ids or ids[0] is None or ids[0] == self.tokenizer.unk_token_id:
            raise ValueError(f"tokenizer has no {token} token: the {self.name} chat format needs it")
        return int(ids[0])

    def _backend(self) -> Any:
        """The Rust tokenizer under a fast HF tokenizer, or None. Called directly it gives the ids and
        text HF's encode/decode give, at half the cost (HF walks every id in Python), as long as no
        padding or truncation was left configured on it (HF's own calls reset those; we fall back)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if (backend is None or not hasattr(backend, "encode_special_tokens")
                or backend.padding is not None or backend.truncation is not None):
            return None
        return backend

    def encode(self, text: str) -> list[int]:
        """Plain text to ids; special-token strings inside `text` stay plain text."""
        if not text:
            return []
        backend = self._backend()
        if backend is None:
            return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
        if not backend.encode_special_tokens:  # = split_special_tokens; HF sets it on every call of its own
            backend.encode_special_tokens = True
        return backend.encode(text, add_special_tokens=False).ids

    def decode_raw(self, ids: Sequence[int]) -> str:
        """Ids to text exactly: special tokens shown, no clean-up of spaces. A byte-level tokenizer's ids are
        read through a table of their bytes (`core.renderers.bytelevel`: the same text, checked, at a fifth of the
        cost)."""
        backend = self._backend()
        if backend is None:
            return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        table = byte_table(self.tokenizer, backend)
        text = None if table is None else table.decode(ids)
        if text is None and table is not None:  # an id past the table: made again if tokens were added since
            table = byte_table(self.tokenizer, backend, fresh=True)
            text = None if table is None else table.decode(ids)
        return backend.decode(list(ids), skip_special_tokens=False) if text is None else text

    def encode_cached(self, text: str) -> list[int]:
        """`encode` for text that episodes repeat: a system prompt with its tool schemas (long to
        tokenise), and the turns the G rollouts of a group share (the question, often a tool's result), where
        tokenising even a short text is the largest cost of a turn (docs/performance.md#smaller-measurements).
        Tokenised once while it is among the texts used last (`cache_ids` ids in all); each caller gets its own
        copy."""
        ids = self._encoded.get(text)
        if ids is not None:
            self._encoded.move_to_end(text)
            return list(ids)
        ids = self._encoded[text] = self.encode(text)
        self._encoded_ids += len(ids)
        while self._encoded_ids > self.cache_ids and len(self._encoded) > 1:
            self._encoded_ids -= len(self._encoded.popitem(last=False)[1])
        return list(ids)

    def encode_reply(self, text: str) -> list[int]:
        """An assistant reply's text to ids (a format whose replies hold structural tokens keeps them)."""
        return self.encode(text)

    def pieces(self, *parts: int | str) -> list[int]:
        """Ids of a run of structural token ids (int) and text (str); adjacent texts are encoded as
        one string, as a tokenizer reading the whole rendered text would."""
        ids: list[int] = []
        text = ""
        for part in parts:
            if isinstance(part, str):
                text += part
                continue
            ids += self.encode(text) + [part]
            text = ""
        return ids + self.encode(text)

    def render_text(self, ids: Sequence[int]) -> str:
        """Any ids, special tokens shown, for humans and debugging."""
        return self.decode_raw(ids)

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id or 0

    @property
    @abc.abstractmethod
    def stop_token_ids(self) -> list[int]:
        """Ids that end an assistant turn (the sampler stops on them and keeps them)."""

    # -- conversations ---------------------------------------------------------------------------
    @abc.abstractmethod
    def render(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] = (),
               add_generation_prompt: bool = True) -> list[int]:
        """A whole conversation (the first message may be the system prompt) with tool schemas."""

    @abc.abstractmethod
    def continuation(self, messages: Sequence[Message], after_stop: bool = True) -> list[int]:
        """Ids to append after a sampled assistant turn: close it, add `messages` (user or tool),
        prompt the assistant again. `after_stop` is False when the turn ended without a stop token."""

    def next_context(self, conversation: Sequence[Message], new_messages: Sequence[Message],
                     tools: Sequence[dict[str, Any]], buffer_ids: Sequence[int],
                     after_stop: bool = True) -> tuple[list[int], bool]:
        """What enters the buffer after a sampled turn, given the whole `conversation` (which ends with
        `new_messages`): (ids to append, False), or (a fresh context, True) to start a new segment."""
        return self.continuation(new_messages, after_stop), False

    def extend_or_restart(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]],
                          buffer_ids: Sequence[int]) -> tuple[list[int], bool]:
        """The whole render of `messages` as what enters a buffer holding `buffer_ids`: the new ids when
        the render extends the buffer token for token (False), else the whole render (True: a new
        segment starts). Sampled ids are never re-tokenised."""
        full = self.render(messages, tools)
        n = len(buffer_ids)
        if len(full) > n and full[:n] == list(buffer_ids):
            return full[n:], False
        return full, True

    def decode(self, ids: Sequence[int]) -> str:
        """Sampled ids to the text of the turn (a trailing stop token dropped)."""
        return self.decode_raw(ids[:-1] if ids and ids[-1] in self.stop_token_ids else ids)

    @abc.abstractmethod
    def parse_tool_calls(self, text: str) -> list[ToolCall]:
        """Every tool call attempted in a turn's text, in order, malformed ones with their `error`."""

    @abc.abstractmethod
    def format_reply(self, content: str, tool_calls: Sequence[ToolCall] = ()) -> str:
        """The text of an assistant turn saying `content` and then making `tool_calls`, written the
        way this family writes them (demonstrations, scripted solvers, a person playing)."""

    def calls_in_reasoning(self, text: str) -> int:
        """Tool calls a reply wrote inside its reasoning, which this family does not read as calls (a violation
        `runs.metrics.violation_metrics` counts); 0 for a family whose replies have no reasoning block."""
        return 0

    def parse(self, ids: Sequence[int]) -> Message:
        """A sampled assistant turn as a message: its exact text and the tool calls parsed from it."""
        text = self.decode(ids)
        return Message("assistant", text, tool_calls=tuple(self.parse_tool_calls(text)))

    def call_opening(self) -> list[int]:
        """The ids that open a tool call at the start of a turn, up to the tool's name, as this family writes a call
        (`format_reply`): what a branch forces at the tool decision (`rollout.branching`); [] if a call's text does
        not hold its name verbatim."""
        mark = "zq_tool_name"
        text = self.format_reply("", [ToolCall(mark, {})])
        return self.encode_reply(text[:text.index(mark)]) if mark in text else []

    def reply_ids(self, reply: Message) -> list[int]:
        """A hand-written reply as the ids a policy would sample for it, stop token included."""
        ids = self.encode_reply(self.format_reply(reply.content, reply.tool_calls))
        return [*ids, self.stop_token_ids[0]]
