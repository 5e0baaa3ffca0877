"""Byte-level BPE ids decoded through a table of each id's bytes: the tokenizer's own text at a fifth of its cost.

Owns: `ByteTable` (each id's bytes, built from the tokenizer and checked id by id against its own decode
before it is used; `decode`), and `byte_table`, one table per tokenizer object, made again when an id is past
it (tokens added since).
Does not own: when a renderer decodes or which tokenizer it has (`core.renderers.base`), encoding.

Why: every sampled turn is decoded once to be parsed (~300 ids in a tool-calling turn). The Rust decoder
clones each id's token string, maps it character by character through a hash map to bytes, then reads the
bytes as UTF-8 (invalid sequences replaced): more, over a turn's ids, than the rest of parsing the turn. With
GPT-2's byte-level scheme (SmolLM2, Qwen2.5/3, Llama 3, gpt-oss, ...) that map is fixed, so each id stands
for fixed bytes, and the text of a sequence of ids is the UTF-8 reading (with replacement) of their bytes
joined: what the Rust decoder computes, here one table lookup an id. The table is built once per tokenizer
(a fraction of a second to a second, by vocabulary size: docs/performance.md#smaller-measurements) and used
only if every id alone decodes to exactly what the tokenizer's own decode gives; a tokenizer with any other
decoder (SentencePiece's: Gemma, Llama 2) keeps its own decode.
"""

from __future__ import annotations

import functools
import operator
import struct
import weakref
from collections.abc import Sequence
from typing import Any


@functools.cache
def _char_bytes() -> dict[str, int]:
    """GPT-2's byte-to-character map, inverted: the character a byte-level BPE writes for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + k): b for k, b in enumerate(others)}}


class ByteTable:
    """The bytes of every id of one byte-level tokenizer (`size` ids, those added included)."""

    def __init__(self, backend: Any, size: int):
        char_bytes, self.size = _char_bytes(), size
        self.bytes: list[bytes] = []
        for i in range(size):
            token = backend.id_to_token(i)
            try:  # a token with a character outside the map is decoded as its own UTF-8, as the Rust decoder does
                self.bytes.append(b"" if token is None else bytes(map(char_bytes.__getitem__, token)))
            except KeyError:
                self.bytes.append(token.encode())

    def agrees_with(self, backend: Any) -> bool:
        """Whether every id alone decodes to what the tokenizer's own decode gives."""
        own = backend.decode_batch([[i] for i in range(self.size)], skip_special_tokens=False)
        return own == [b.decode("utf-8", "replace") for b in self.bytes]

    def decode(self, ids: Sequence[int]) -> str | None:
        """The text of `ids`; None for an id outside the table (the tokenizer's own decode then says what it is).

        One C call looks every id up (`itemgetter`), after another that refuses a negative id, which would read the
        table from its end (struct's unsigned format): faster than a lookup an id through `map` after
        `min(ids) < 0` (docs/performance.md#the-runner-at-scale-by-simulation)."""
        if not ids:
            return ""
        try:
            struct.pack(f"{len(ids)}Q", *ids)
            pieces = operator.itemgetter(*ids)(self.bytes)
        except (IndexError, TypeError, struct.error):
            return None
        return (b"".join(pieces) if len(ids) > 1 else pieces).decode("utf-8", "replace")


# tokenizer object -> (its size when the table was made, the table or None where it cannot be used)
_TABLES: weakref.WeakKeyDictionary[Any, tuple[int, ByteTable | None]] = weakref.WeakKeyDictionary()


def byte_table(tokenizer: Any, backend: Any, fresh: bool = False) -> ByteTable | None:
    """The table of `tokenizer` (whose Rust tokenizer is `backend`), or None where its decoder is not byte-level
    or the table disagrees with it. Made once per tokenizer object; `fresh`: made again if tokens were added
    since (their ids come after the table's, so a table that reads an id never reads it wrong)."""
    known = _TABLES.get(tokenizer)
    if known is not None and not fresh:
        return known[1]
    size = backend.get_vocab_size(with_added_tokens=True)
    if known is not None and known[0] == size:
        return known[1]
    from tokenizers import decoders

    table = ByteTable(backend, size) if isinstance(backend.decoder, decoders.ByteLevel) else None
    if table is not None and not table.agrees_with(backend):
        table = None
    _TABLES[tokenizer] = (size, table)
    return table
