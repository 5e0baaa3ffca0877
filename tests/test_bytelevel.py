"""Decoding through a table of each id's bytes (`core.renderers.bytelevel`) gives exactly the fast tokenizer's own text:
on SmolLM2's, Qwen2.5's and stand-in tokenizers with added tokens, for every id alone, for random sequences
(which cut characters in half and mix in special tokens), and for sampled-looking turns; a tokenizer whose
decoder is not byte-level (Gemma 3's) keeps its own decode."""

from __future__ import annotations

import random

import pytest

from agent_rl.core.renderers import bytelevel
from agent_rl.core.renderers.chatml import ChatMLRenderer
from agent_rl.core.renderers.gemma3 import Gemma3Renderer


def own(tokenizer, ids):
    return tokenizer.backend_tokenizer.decode(list(ids), skip_special_tokens=False)


def random_sequences(size: int, n: int = 3000, seed: int = 0):
    rng = random.Random(seed)
    return [[rng.randrange(size) for _ in range(rng.randint(1, 24))] for _ in range(n)]


@pytest.mark.parametrize("name", ["smol_tokenizer", "qwen25_tokenizer", "qwen3_standin", "llama3_standin"])
def test_the_table_decodes_every_id_and_random_sequences_as_the_tokenizer_does(request, name):
    tokenizer = request.getfixturevalue(name)
    table = bytelevel.byte_table(tokenizer, tokenizer.backend_tokenizer)
    assert table is not None and table.size == tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    assert table.agrees_with(tokenizer.backend_tokenizer)  # every id alone
    for ids in random_sequences(table.size):
        assert table.decode(ids) == own(tokenizer, ids)
    added = sorted(tokenizer.get_added_vocab().values())  # special and added tokens between halves of characters
    text_ids = tokenizer.encode("naïve café ✓ 数学 🙂 <tool_call>", add_special_tokens=False)
    mixed = [*text_ids[:5], added[0], *text_ids[5:], added[-1], text_ids[-3]]
    assert table.decode(mixed) == own(tokenizer, mixed)


def test_a_renderer_decodes_through_the_table_and_falls_back_for_ids_outside_it(smol_tokenizer):
    renderer = ChatMLRenderer(smol_tokenizer)
    ids = renderer.encode("Let me call the tool.\n<tool_call>\n{\"name\": \"calculator\"}\n</tool_call>")
    assert renderer.decode_raw([*ids, renderer.im_end]) == own(smol_tokenizer, [*ids, renderer.im_end])
    table = bytelevel.byte_table(smol_tokenizer, smol_tokenizer.backend_tokenizer)
    assert table is not None and table.decode([table.size]) is None and table.decode([-1]) is None
    assert table.decode([]) == renderer.decode_raw([]) == ""
    # one id alone (itemgetter gives its piece, not a tuple of pieces), and an id that is not an int
    assert table.decode([ids[0]]) == own(smol_tokenizer, [ids[0]]) and table.decode((ids[0], 5.0)) is None
    with pytest.raises(OverflowError):  # what the tokenizer's own decode says of a negative id
        renderer.decode_raw([5, -1])


def test_tokens_added_later_are_decoded_through_a_table_made_again(smol_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    renderer = ChatMLRenderer(tokenizer)
    text_ids = renderer.encode("ok 🙂")
    assert renderer.decode_raw(text_ids) == "ok 🙂"
    first = bytelevel.byte_table(tokenizer, tokenizer.backend_tokenizer)
    tokenizer.add_tokens(["üü", "ĠĠzz"])  # characters the byte map reads as bytes: "üü" is not valid UTF-8 then
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool sep|>"]})
    assert bytelevel.byte_table(tokenizer, tokenizer.backend_tokenizer) is first  # old ids: still right
    new = tokenizer.convert_tokens_to_ids(["üü", "ĠĠzz", "<|tool sep|>"])
    ids = [*new, *text_ids, new[0]]
    assert renderer.decode_raw(ids) == own(tokenizer, ids)
    second = bytelevel.byte_table(tokenizer, tokenizer.backend_tokenizer)
    assert first is not None and second is not None and second.size == first.size + 3
    assert second.decode(ids) == own(tokenizer, ids)


def test_a_tokenizer_that_is_not_byte_level_keeps_its_own_decode(gemma3_tokenizer):
    assert bytelevel.byte_table(gemma3_tokenizer, gemma3_tokenizer.backend_tokenizer) is None
    renderer = Gemma3Renderer(gemma3_tokenizer)
    ids = gemma3_tokenizer.encode("naïve café ✓ 数学 🙂", add_special_tokens=False)
    assert renderer.decode_raw(ids) == own(gemma3_tokenizer, ids) == "naïve café ✓ 数学 🙂"


def test_a_table_that_disagrees_with_the_tokenizer_is_not_used(smol_tokenizer, monkeypatch):
    """The check before use: a table whose bytes differ from the tokenizer's own decode for one id is dropped."""
    backend = smol_tokenizer.backend_tokenizer
    table = bytelevel.ByteTable(backend, backend.get_vocab_size(with_added_tokens=True))
    assert table.agrees_with(backend)
    table.bytes[100] = b"?"
    assert not table.agrees_with(backend)
