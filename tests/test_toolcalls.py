"""Tool-call parsing: every attempted call is found; every malformed one says what is wrong."""

import pytest

from agent_rl.core.renderers.choose import get_renderer
from agent_rl.core.renderers.toolcalls import parse_bare_calls, parse_tool_calls
from agent_rl.core.types import ToolCall


def test_no_call_means_no_attempt():
    assert parse_tool_calls("The answer is 4.") == []


def test_several_calls_in_order():
    text = ('first <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call> then '
            '<tool_call>{"name": "mul", "arguments": {"a": 3}}</tool_call>')
    got = parse_tool_calls(text)
    assert got == [ToolCall("add", {"a": 1, "b": 2}, "call_1"), ToolCall("mul", {"a": 3}, "call_2")]
    assert all(p.ok for p in got)


def test_string_encoded_arguments_are_accepted():
    (p,) = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert p == ToolCall("f", {"x": 1}, "call_1")


def test_malformed_json():
    (p,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>')
    assert not p.ok and p.arguments == {}
    assert p.error.startswith("tool call 1: malformed JSON (Expecting property name enclosed in double quotes")


def test_not_an_object_missing_name_bad_arguments_extra_keys():
    errors = [p.error for p in parse_tool_calls(
        '<tool_call>[1]</tool_call><tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call><tool_call>{"name": "f", "args": {}}</tool_call>')]
    assert errors == [
        'tool call 1: expected a JSON object with "name" and "arguments", got list',
        'tool call 2: missing "name" (a string naming the tool)',
        'tool call 3 (f): "arguments" must be a JSON object, got list',
        "tool call 4 (f): unexpected keys ['args']; use {\"name\": ..., \"arguments\": {...}}",
    ]


def test_unclosed_tag_at_end_and_before_another_call():
    (p,) = parse_tool_calls('ok <tool_call>{"name": "add"')
    assert p.error == "tool call 1: unclosed <tool_call> tag (no </tool_call> after '{\"name\": \"add\"')"
    got = parse_tool_calls('<tool_call>{"name": "a" <tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert got[0].error == "tool call 1: unclosed <tool_call> tag before another <tool_call>"
    assert got[1] == ToolCall("b", {}, "call_2")


def test_stray_closing_tag():
    (p,) = parse_tool_calls("done </tool_call>")
    assert p.error == "tool call 1: </tool_call> without a matching <tool_call>"


# -- bare calls: the same JSON without the tags (parse_bare_calls; a renderer's bare_calls switch) ------------
def test_bare_call_one_object():
    assert parse_bare_calls('{"name": "calculator", "arguments": {"expression": "2 * 6"}}') == [
        ToolCall("calculator", {"expression": "2 * 6"}, "call_1")]
    # whitespace around it, or a ```json fence, as small models write it
    assert parse_bare_calls('\n {"name": "f", "arguments": {}}\n') == [ToolCall("f", {}, "call_1")]
    assert parse_bare_calls('```json\n{"name": "f", "arguments": {"x": 1}}\n```') == [ToolCall("f", {"x": 1}, "call_1")]


def test_bare_calls_two_objects_are_two_calls():
    text = '{"name": "add", "arguments": {"a": 1}}\n{"name": "mul", "arguments": {"b": 2}}'
    assert parse_bare_calls(text) == [ToolCall("add", {"a": 1}, "call_1"), ToolCall("mul", {"b": 2}, "call_2")]
    fenced = '```json\n{"name": "add", "arguments": {}}\n```\n```json\n{"name": "mul", "arguments": {}}\n```'
    assert [c.name for c in parse_bare_calls(fenced)] == ["add", "mul"]
    # two objects in one fence: two calls (a parallel reply, below)
    assert [c.name for c in parse_bare_calls('```json\n{"name": "a", "arguments": {}}\n{"name": "b", "arguments": '
                                             '{}}\n```')] == ["a", "b"]


def test_json_inside_prose_is_text_not_a_call():
    assert parse_bare_calls('I will call {"name": "add", "arguments": {"a": 1}} now.') == []
    assert parse_bare_calls('{"name": "add", "arguments": {"a": 1}} and then I answer 4.') == []
    assert parse_bare_calls('The answer is 12.\n{"name": "add", "arguments": {}}') == []


def test_bare_call_to_an_unknown_tool_is_a_call_the_environment_refuses():
    # the parser does not know the tools; ToolEnv answers "unknown tool ..." as for a tagged call
    assert parse_bare_calls('{"name": "lookup_answer", "arguments": {"q": "2+2"}}') == [
        ToolCall("lookup_answer", {"q": "2+2"}, "call_1")]


def test_broken_json_and_other_objects_are_text():
    for text in ['{"name": "add", "arguments": {"a": 1,}}',  # broken JSON: no call was made
                 '{"name": "add", "arguments": {"a": 1}',  # cut short
                 '{"answer": 12}', '{"name": "Ada", "age": 36}',  # objects that are answers
                 '[{"name": "add", "arguments": {}}, {"answer": 3}]', '[]', '[1, 2]', '"add"', "12", ""]:
        assert parse_bare_calls(text) == [], text


def test_bare_call_shapes_the_tagged_parser_refuses_are_refused_alike():
    (p,) = parse_bare_calls('{"name": "f", "arguments": [1]}')
    assert p.error == 'tool call 1 (f): "arguments" must be a JSON object, got list'
    (p,) = parse_bare_calls('{"name": "f", "arguments": "{\\"x\\": 1}"}')  # string-encoded: read, as tagged
    assert p == ToolCall("f", {"x": 1}, "call_1")


def test_the_bare_call_switch_per_renderer_and_config(qwen25_tokenizer, smol_tokenizer, gemma3_tokenizer,
                                                     qwen3_standin):
    assert get_renderer(qwen25_tokenizer).bare_calls is True  # qwen2_5: on by default
    assert get_renderer(smol_tokenizer).bare_calls is False  # chatml: off
    assert get_renderer(qwen25_tokenizer, bare_calls=False).parse_tool_calls('{"name": "f", "arguments": {}}') == []
    assert get_renderer(smol_tokenizer, bare_calls=True).parse_tool_calls('{"name": "f", "arguments": {}}') == [
        ToolCall("f", {}, "call_1")]
    # tags win: a reply with a tagged call is read as tagged, whatever else it holds
    r = get_renderer(qwen25_tokenizer)
    assert [c.name for c in r.parse_tool_calls('<tool_call>{"name": "g", "arguments": {}}</tool_call>')] == ["g"]
    with pytest.raises(ValueError) as e:
        get_renderer(gemma3_tokenizer, bare_calls=True)
    assert str(e.value) == ("model.bare_tool_calls: the gemma3 renderer has no bare-call reading (it has: chatml, "
                            "qwen2_5, qwen3, qwen3_nothink); leave it unset (got True)")
    assert get_renderer(gemma3_tokenizer).bare_calls is None
    # qwen3: off by default; on, a bare call after the reasoning counts, one inside it does not
    reply = '<think>\n{"name": "f", "arguments": {}}\n</think>\n\n{"name": "g", "arguments": {}}'
    assert get_renderer(qwen3_standin).parse_tool_calls(reply) == []
    assert get_renderer(qwen3_standin, bare_calls=True).parse_tool_calls(reply) == [ToolCall("g", {}, "call_1")]


# -- parallel calls: the forms a reply meaning several calls at once is written in (module doc) ------------------
PARIS = {"name": "get_temperature", "arguments": {"city": "Paris"}}
TOKYO = {"name": "get_temperature", "arguments": {"city": "Tokyo"}}
BOTH = [ToolCall("get_temperature", {"city": "Paris"}, "call_1"), ToolCall("get_temperature", {"city": "Tokyo"},
                                                                            "call_2")]


def _j(obj) -> str:
    import json

    return json.dumps(obj)


@pytest.mark.parametrize("text", [
    f"<tool_call>\n{_j(PARIS)}\n</tool_call>\n<tool_call>\n{_j(TOKYO)}\n</tool_call>",  # a block each
    f"<tool_call>\n{_j([PARIS, TOKYO])}\n</tool_call>",  # a JSON list in one block
    f"<tool_call>\n{_j(PARIS)}\n{_j(TOKYO)}\n</tool_call>",  # two objects in one block
    f"<tool_call>\n{_j(PARIS)},\n{_j(TOKYO)}\n</tool_call>",  # ... with a comma between
    f"Let me check both.\n<tool_call>{_j([PARIS, TOKYO])}</tool_call>",
])
def test_parallel_calls_in_tags_are_the_calls_meant(text):
    assert parse_tool_calls(text) == BOTH


@pytest.mark.parametrize("text", [
    f"{_j(PARIS)}\n{_j(TOKYO)}",  # bare objects, one a line
    _j([PARIS, TOKYO]),  # a bare JSON list
    f"```json\n{_j([PARIS, TOKYO])}\n```",  # a list in a fence
    f"```json\n{_j(PARIS)}\n```\n```json\n{_j(TOKYO)}\n```",  # a fence each
    f"```json\n{_j(PARIS)},\n{_j(TOKYO)}\n```",  # two in one fence
])
def test_parallel_bare_calls_are_the_calls_meant(text):
    assert parse_bare_calls(text) == BOTH


def test_a_block_with_a_list_that_is_not_all_calls_is_one_bad_call():
    (p,) = parse_tool_calls("<tool_call>[1, 2]</tool_call>")
    assert p.error == 'tool call 1: expected a JSON object with "name" and "arguments", got list'
    # a list of objects is read object by object: a bad one says what is wrong with it, at its own index
    got = parse_tool_calls(f'<tool_call>{_j([PARIS, {"arguments": {}}])}</tool_call><tool_call>{_j(TOKYO)}</tool_call>')
    assert [c.ok for c in got] == [True, False, True] and [c.id for c in got] == ["call_1", "call_2", "call_3"]
    assert got[1].error == 'tool call 2: missing "name" (a string naming the tool)'
