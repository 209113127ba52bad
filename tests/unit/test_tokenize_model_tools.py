"""The router renders a tool-calling chat request as vLLM does: the request's tools (dumped as
vLLM's pydantic model dumps them), documents, chat_template_kwargs, an assistant's tool calls with
their JSON arguments parsed, continue_final_message; and refuses (``Unrenderable``: prefix
affinity) what it cannot be sure of."""

from __future__ import annotations

import pytest

from llmgw.router.tokenize_model import (EngineChatSettings, ModelTokenizer, Unrenderable, conversation,
                                         render_kwargs, tool_dicts)
from tests.support.tinytokenizer import TEMPLATE, TOOLS_TEMPLATE, VOCAB, model_dir

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}, "extra": 1}}
CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"b": 1, "a": "x"}'}}
TOOL_CHAT = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": None, "tool_calls": [CALL]},
             {"role": "tool", "content": "a", "tool_call_id": "c1"}]


@pytest.fixture
def tok(tmp_path):
    return ModelTokenizer.from_directory(str(model_dir(tmp_path, template=TOOLS_TEMPLATE)))


def test_tools_kwargs_and_tool_calls_are_rendered_as_vllm_hands_them_over(tok):
    req = {"messages": TOOL_CHAT, "tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": False}}
    assert tok.render_chat(**req) == (
        '<|im_start|>system\n{"type": "function", "function": {"name": "weather", "description": null, '
        '"parameters": {"type": "object"}}}\n<|im_end|>\n'  # null description kept, unknown keys dropped
        "<|im_start|>user\nhi<|im_end|>\n"
        '<|im_start|>assistant\nc1 weather {"b": 1, "a": "x"}<|im_end|>\n'  # arguments parsed, order kept
        "<|im_start|>tool\na for c1<|im_end|>\n"
        "<|im_start|>assistant\na b\n")
    ids = tok.token_ids(req, 1000)
    assert ids[:2] == [VOCAB["<|im_start|>"], VOCAB["system"]]
    assert ids[-3:] == [VOCAB["assistant"], VOCAB["a"], VOCAB["b"]]
    # the old rendering: no tools, the kwarg ignored, the call's content None
    assert tok.token_ids({"messages": [{"role": "user", "content": "hi"}]}, 9)[:2] != ids[:2]


def test_documents_from_the_request_or_its_kwargs(tok):
    docs = [{"title": "a", "text": "b"}]
    plain = tok.render_chat([{"role": "user", "content": "hi"}], documents=docs)
    assert plain.startswith("doc a: b\n<|im_start|>user")
    assert tok.render_chat([{"role": "user", "content": "hi"}], chat_template_kwargs={"documents": docs}) == plain
    with pytest.raises(Unrenderable):
        tok.render_chat([{"role": "user", "content": "hi"}], chat_template_kwargs={"documents": ["b"]})


def test_tool_dicts_dump_as_the_pydantic_model():
    assert tool_dicts([{"function": {"name": "f", "strict": True, "description": "d"}, "defer_loading": True}]) == [
        {"type": "function", "function": {"name": "f", "description": "d", "parameters": None, "strict": True,
                                          "defer_loading": True}, "defer_loading": True}]
    for bad in ([], [{"type": "custom", "function": {"name": "f"}}], [{"function": {"name": 1}}],
                [{"function": {"name": "f", "strict": "yes"}}], "f"):
        with pytest.raises(Unrenderable):
            tool_dicts(bad)


def test_tool_call_arguments_are_parsed_and_messages_rebuilt():
    calls = [dict(CALL, function={"name": "f", "arguments": a}) for a in ('{"x": [1]}', "", "not json", "[1]")]
    (user, asst, tool) = conversation([
        {"role": "user", "content": ["hi", {"type": "text", "text": ""}, "there"], "extra": 1, "name": "bob"},
        {"role": "assistant", "content": None, "tool_calls": calls, "reasoning": "hm"},
        {"role": "tool", "content": [{"type": "text", "text": "r"}], "tool_call_id": "c1"}])
    assert user == {"role": "user", "content": "hi\nthere", "name": "bob"}  # empty part skipped, extra key dropped
    assert [c["function"]["arguments"] for c in asst["tool_calls"]] == [{"x": [1]}, {}, {}, {}]
    assert list(asst["tool_calls"][0]) == ["id", "function", "type"] and asst["content"] == ""
    assert asst["reasoning"] == asst["reasoning_content"] == "hm"
    assert tool == {"role": "tool", "content": "r", "tool_call_id": "c1"}
    assert "tool_calls" not in conversation([{"role": "assistant", "content": "x", "tool_calls": []}])[0]
    for bad in ({"function": {"name": "f", "arguments": "{}"}, "type": "function"},  # no id: vLLM refuses
                {"id": "c", "function": {"name": "f", "arguments": {"a": 1}}, "type": "function"}):
        with pytest.raises(Unrenderable):
            conversation([{"role": "assistant", "content": "x", "tool_calls": [bad]}])


def test_developer_messages_become_one_system_message_where_the_template_lacks_the_role():
    msgs = [{"role": "system", "content": "a"}, {"role": "user", "content": "u"}, {"role": "developer", "content": "d"}]
    assert conversation(msgs, developer_role=False) == [{"role": "system", "content": "a\n\nd"},
                                                        {"role": "user", "content": "u"}]
    assert conversation(msgs)[2] == {"role": "developer", "content": "d", "tools": None}


def test_tool_choice_none_depends_on_the_engines_flag(tmp_path):
    req = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "tool_choice": "none"}
    unknown = ModelTokenizer.from_directory(str(model_dir(tmp_path, template=TOOLS_TEMPLATE)))
    with pytest.raises(Unrenderable):
        unknown.token_ids(req, 9)
    excluded = ModelTokenizer.from_directory(str(model_dir(tmp_path, template=TOOLS_TEMPLATE)),
                                             EngineChatSettings(exclude_tools_when_tool_choice_none=True))
    kept = ModelTokenizer.from_directory(str(model_dir(tmp_path, template=TOOLS_TEMPLATE)),
                                         EngineChatSettings(exclude_tools_when_tool_choice_none=False))
    assert excluded.render_chat(**req).startswith("<|im_start|>user")
    assert kept.render_chat(**req) == kept.render_chat(**{**req, "tool_choice": "auto"})
    assert kept.render_chat(**req).startswith("<|im_start|>system")


def test_continue_final_message_ends_where_the_message_does(tmp_path):
    tok = ModelTokenizer.from_directory(str(model_dir(tmp_path, template=TEMPLATE)))
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "be "}]
    assert tok.render_chat(msgs, add_generation_prompt=False, continue_final_message=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nbe ")
    with pytest.raises(Unrenderable):  # vLLM refuses both
        tok.render_chat(msgs, continue_final_message=True)


def test_reasoning_effort_matters_only_where_the_template_reads_it(tok, tmp_path):
    req = {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "none"}
    with pytest.raises(Unrenderable):  # the template reads enable_thinking: the engine's effort map decides
        tok.token_ids(req, 9)
    mapped = ModelTokenizer.from_directory(str(model_dir(tmp_path, template=TOOLS_TEMPLATE)),
                                           EngineChatSettings(reasoning_effort_map={}))
    assert mapped.render_chat(**req).endswith("assistant\na b\n")
    plain = ModelTokenizer.from_directory(str(model_dir(tmp_path, template=TEMPLATE)))
    assert plain.token_ids(req, 99) == plain.token_ids({"messages": req["messages"]}, 99)


@pytest.mark.parametrize("extra", [{"chat_template": "x"}, {"chat_template_kwargs": {"chat_template": "x"}},
                                   {"chat_template_kwargs": {"tokenize": True}},
                                   {"chat_template_kwargs": {"tools": []}}, {"chat_template_kwargs": "x"},
                                   {"add_generation_prompt": "yes"}, {"tools": []}, {"documents": "d"}])
def test_what_the_router_cannot_be_sure_of_is_unrenderable(tok, extra):
    with pytest.raises(Unrenderable):
        tok.token_ids({"messages": [{"role": "user", "content": "hi"}], **extra}, 9)


def test_kwargs_of_none_or_auto_and_unread_ones_change_nothing():
    kw = render_kwargs({"chat_template_kwargs": {"enable_thinking": None, "mode": "auto", "x": 1}}, frozenset())
    assert kw == {"add_generation_prompt": True, "continue_final_message": False, "x": 1}
