"""tools/base.py: a tool's arguments model and schema are built once per function and shared by every
`Tool` of it (every episode builds its environment's tools anew), yet methods, closures and names
stay apart."""

from __future__ import annotations

import gc

import pytest

from agent_rl.tools import base
from agent_rl.tools.base import Tool, ToolError


def add(a: int, b: int = 1) -> int:
    """Add two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


class Counter:
    def __init__(self, start: int):
        self.start = start

    def bump(self, by: int) -> int:
        """Count up."""
        return self.start + by


def test_tools_of_one_function_share_its_model_and_schema():
    first, second = Tool(add), Tool(add)
    assert first.params_model is second.params_model
    assert first.schema == second.schema == {
        "type": "function",
        "function": {"name": "add", "description": "Add two numbers.", "parameters": {
            "type": "object", "additionalProperties": False, "required": ["a"],
            "properties": {"a": {"type": "integer", "description": "The first."},
                           "b": {"type": "integer", "default": 1, "description": "The second."}}}},
    }
    first.schema["function"]["name"] = "changed"  # each call hands out its own copy
    assert first.schema["function"]["name"] == "add"
    assert Tool(add, name="plus").params_model is not first.params_model  # the name is in the model
    assert Tool(add, name="plus").schema["function"]["name"] == "plus"


def big(n: int = 123456789012345678901234567890, x: float = float("nan")) -> int:
    """Defaults orjson would not read as json does."""
    return n


def test_a_schema_holds_its_numbers_as_json_reads_them():
    """An integer past 64 bits stays that integer (orjson would make it a float), NaN stays NaN (orjson refuses
    it): such a schema is read by json, every other one by orjson."""
    props = Tool(big).schema["function"]["parameters"]["properties"]
    assert props["n"]["default"] == 123456789012345678901234567890 and type(props["n"]["default"]) is int
    assert props["x"]["default"] != props["x"]["default"]  # NaN
    assert base._schema(Tool(big).params_model, "big", "")[1] is False
    assert base._schema(Tool(add).params_model, "add", "")[1] is True


async def test_bound_methods_share_the_model_and_call_their_own_instance():
    one, two = Tool(Counter(10).bump), Tool(Counter(20).bump)
    assert one.params_model is two.params_model
    assert list(one.schema["function"]["parameters"]["properties"]) == ["by"]  # no `self`
    assert (await one.call({"by": 1})).content == "11"
    assert (await two.call({"by": 1})).content == "21"
    with pytest.raises(ToolError, match="invalid arguments for bump"):
        one.validate({"by": 1, "extra": 2})


def test_a_closure_per_environment_gets_its_own_entry_and_takes_it_along():
    def make(limit: int):
        def clip(x: int, cap: int = limit) -> int:
            """Clip a number."""
            return min(x, cap)
        return clip

    low, high = make(3), make(300)
    assert Tool(low).schema["function"]["parameters"]["properties"]["cap"]["default"] == 3
    assert Tool(high).schema["function"]["parameters"]["properties"]["cap"]["default"] == 300
    before = len(base._MODELS)
    del low, high
    gc.collect()
    assert len(base._MODELS) == before - 2


def test_a_function_without_annotations_is_still_refused():
    def bad(x):
        return x

    with pytest.raises(TypeError, match="parameter 'x' has no type annotation"):
        Tool(bad)


def test_validate_gives_every_declared_argument_as_its_type_and_a_fresh_dict_each_call():
    tool = Tool(add)
    first = tool.validate({"a": "2"})  # lax mode, as model_validate: a numeric string is the int
    assert first == {"a": 2, "b": 1} and type(first["a"]) is int  # the default filled in, nothing else
    first["a"] = 99  # the caller's own dict
    assert tool.validate({"a": 5, "b": 6}) == {"a": 5, "b": 6}
    with pytest.raises(ToolError, match=r"invalid arguments for add: a: Input should be a valid integer"):
        tool.validate({"a": "two"})
    with pytest.raises(ToolError, match=r"invalid arguments for add: a: Field required"):
        tool.validate({"b": 1})
