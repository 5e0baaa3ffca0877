"""The JSON text of a request's prompt ids, made from the text of the conversation's last prompt.

Owns: `PromptJSON`, which keeps, for each conversation (the identity of its first message, which the runner
passes with every request), the ids and JSON text of its last prompt, the least recently used dropped past
`max_ids` ids in all; a prompt that starts with the kept ids costs only its new ids.
Does not own: the rest of the request body, or the request (`rollout.sampler`); the ids themselves.

Why: a multi-turn episode's prompt is its last prompt, the turn's sampled ids and the environment's reply, and
the whole context is sent again every turn. `json.dumps` writes each id as decimal text, ~55 ns an id here: the
largest client-side cost of a turn at ~650 ids, and 0.45 ms a request at an 8k context. Written this way each
id is written once per episode. The kept ids are compared with the new prompt's first ids (a C comparison,
~2 us at 1k ids), so a key that matches the wrong thing (an object freed and its id given to another, first
messages shared between episodes, a history the environment replaced) costs a full write, never a wrong prompt.
"""

from __future__ import annotations

import json
from collections import OrderedDict


def ids_json(ids: list[int]) -> str:
    """`ids` as a compact JSON array."""
    return json.dumps(ids, separators=(",", ":"))


class PromptJSON:
    """The JSON text of prompts, each conversation's written from its last one's (module doc)."""

    def __init__(self, max_ids: int = 8_000_000):
        self.max_ids = max_ids  # ids kept in all, least recently used out (~13 bytes an id with its text: 100 MB)
        self._kept: OrderedDict[int, tuple[list[int], str]] = OrderedDict()  # id(conversation) -> ids, text
        self._kept_ids = 0

    def text(self, ids: list[int], conversation: object | None = None) -> str:
        """`ids` as a compact JSON array; written from the kept text of `conversation`'s last prompt when `ids`
        starts with that prompt's ids. `ids` is kept (not copied) as the conversation's last prompt."""
        if conversation is None:
            return ids_json(ids)
        key = id(conversation)
        kept = self._kept.pop(key, None)
        if kept is not None:
            self._kept_ids -= len(kept[0])
        n = 0 if kept is None else len(kept[0])
        if kept is not None and 0 < n <= len(ids) and ids[:n] == kept[0]:
            text = kept[1] if n == len(ids) else kept[1][:-1] + "," + ids_json(ids[n:])[1:]
        else:
            text = ids_json(ids)
        self._kept[key] = (ids, text)
        self._kept_ids += len(ids)
        while self._kept_ids > self.max_ids and len(self._kept) > 1:
            self._kept_ids -= len(self._kept.popitem(last=False)[1][0])
        return text
