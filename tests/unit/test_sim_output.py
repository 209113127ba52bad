"""The simulator's stop strings, n and forced tool calls, as vLLM shapes them."""

import json

import pytest

from llmgw.sim.sim_output import BadRequest, choices_count, generate, stop_strings, tool_call
from llmgw.sim.sim_tokens import expected_text


def test_no_stop_string_gives_every_token_and_the_budget_finish():
    out = generate(4, "length", ())
    assert out.text == expected_text(4) and out.tokens == 4 and out.finish_reason == "length"
    assert out.stop_reason is None


def test_a_stop_string_cuts_the_text_where_it_starts_and_counts_the_tokens_that_made_it():
    out = generate(10, "length", (" tok3",))
    assert out.text == "tok0 tok1 tok2" and out.finish_reason == "stop" and out.stop_reason == " tok3"
    assert out.tokens == 4


def test_a_stop_string_spanning_two_tokens_cuts_inside_the_earlier_one():
    out = generate(10, "length", ("k5", "1 t"))
    assert out.text == "tok0 tok" and out.stop_reason == "1 t" and out.tokens == 3
    assert "".join(out.pieces) == out.text


def test_a_stop_string_never_generated_changes_nothing():
    assert generate(3, "length", ("zzz",)) == generate(3, "length", ())


def test_stop_and_n_are_validated_like_vllm():
    assert stop_strings({"stop": "x"}) == ("x",) and stop_strings({"stop": ["a", ""]}) == ("a",)
    assert stop_strings({}) == () and choices_count({}) == 1 and choices_count({"n": 3}) == 3
    with pytest.raises(BadRequest) as e:
        stop_strings({"stop": 3})
    assert e.value.param == "stop"
    with pytest.raises(BadRequest):
        choices_count({"n": 0})


TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "unit": {"enum": ["c", "f"]}, "note": {"type": "string"}},
    "required": ["city", "days", "unit"]}}},
         {"type": "function", "function": {"name": "time"}}]


PARSER = "hermes"  # a --tool-call-parser: vLLM forces no tool call without one


def test_forced_tool_calls_need_a_tool_call_parser_as_in_vllm():
    with pytest.raises(BadRequest, match='tool_choice=function "weather" requires --tool-call-parser'):
        tool_call({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "weather"}}}, None)
    with pytest.raises(BadRequest, match='tool_choice="required" requires --tool-call-parser'):
        tool_call({"tools": TOOLS, "tool_choice": "required"}, None)
    assert tool_call({"tools": TOOLS, "tool_choice": "none"}, None) is None


def test_a_named_tool_choice_calls_it_with_schema_valid_arguments_and_finishes_with_stop():
    call = tool_call({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "weather"}}}, PARSER)
    assert call.name == "weather" and call.finish_reason == "stop"
    assert json.loads(call.arguments) == {"city": "tok0", "days": 0, "unit": "c"}
    entry = call.message_entry()
    assert entry["type"] == "function" and entry["id"].startswith("chatcmpl-tool-")


def test_required_calls_the_first_tool_and_finishes_with_tool_calls():
    call = tool_call({"tools": TOOLS, "tool_choice": "required"}, PARSER)
    assert (call.name, call.finish_reason) == ("weather", "tool_calls")
    assert tool_call({"tools": [], "tool_choice": "required"}, PARSER) is None


def test_auto_without_a_parser_unknown_names_and_no_tools_are_refused_as_vllm_refuses_them():
    assert tool_call({}, PARSER) is None and tool_call({"tools": TOOLS, "tool_choice": "none"}, PARSER) is None
    with pytest.raises(BadRequest, match="--enable-auto-tool-choice"):
        tool_call({"tools": TOOLS}, PARSER)
    with pytest.raises(BadRequest, match="does not match any"):
        tool_call({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, PARSER)
    with pytest.raises(BadRequest, match="`tools` must be set"):
        tool_call({"tool_choice": "required"}, PARSER)
