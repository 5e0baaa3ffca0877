"""Tool-call parsing: every attempted call is found; every malformed one says what is wrong."""

from agent_rl.core.toolcalls import parse_tool_calls
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
