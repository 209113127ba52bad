"""Simulator tokens: prompts counted as words, output token i carries i."""

import pytest

from llmgw.sim.sim_tokens import (
    PromptError,
    TokenBytes,
    chat_prompt_tokens,
    completion_prompts,
    embedding_inputs,
    expected_text,
    token_text,
)


def test_output_token_i_contains_i_and_texts_concatenate_to_words():
    assert [token_text(i) for i in range(3)] == ["tok0", " tok1", " tok2"]
    assert expected_text(4).split() == ["tok0", "tok1", "tok2", "tok3"]
    assert b"".join(TokenBytes().first(3)) == b"tok0 tok1 tok2"


def test_token_bytes_are_stable_across_calls():
    tb = TokenBytes()
    assert tb.first(2) == [b"tok0", b" tok1"]
    assert tb.first(5)[:2] == [b"tok0", b" tok1"]


def test_chat_prompt_renders_roles_and_text_parts():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello there"},
                                     {"type": "image_url", "image_url": {"url": "x"}}]},
    ]
    assert chat_prompt_tokens(messages) == ["system:", "be", "brief", "user:", "hello", "there"]


@pytest.mark.parametrize("bad", [None, [], "hi", [{"content": "no role"}], [{"role": "user", "content": 3}]])
def test_malformed_messages_are_prompt_errors(bad):
    with pytest.raises(PromptError):
        chat_prompt_tokens(bad)


def test_completion_prompt_forms():
    assert completion_prompts("a b") == [["a", "b"]]
    assert completion_prompts(["a", "b c"]) == [["a"], ["b", "c"]]
    assert completion_prompts([1, 2, 3]) == [["1", "2", "3"]]
    assert completion_prompts([[1], [2, 3]]) == [["1"], ["2", "3"]]
    with pytest.raises(PromptError):
        completion_prompts({"x": 1})


def test_embedding_inputs():
    assert embedding_inputs("x y") == ["x y"]
    assert embedding_inputs(["a", "b"]) == ["a", "b"]
    with pytest.raises(PromptError):
        embedding_inputs(None)
