"""A tiny tokenizer directory built in memory, shaped like a chat model's (tokenizer.json with a
WordLevel model, special tokens, a BOS post-processor; tokenizer_config.json; chat_template.jinja),
for the router's model-tokenizer tests: no download, no model weights."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, processors

WORDS = ["user", "assistant", "system", "hi", "there", "be", "brief", "a", "b", "c", "d", "e", "f", "g", "h"]
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
VOCAB = {t: i for i, t in enumerate(SPECIAL + WORDS)}
TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
            "{% endif %}")


def model_dir(tmp_path: Path, config: dict | None = None, template: str | None = TEMPLATE) -> Path:
    """A model directory with a WordLevel tokenizer whose post-processor adds BOS, as Llama's does."""
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", VOCAB["<s>"])])
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "tokenizer.json").write_text(tok.to_str())
    (d / "tokenizer_config.json").write_text(json.dumps(
        config if config is not None else {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    if template is not None:
        (d / "chat_template.jinja").write_text(template)
    return d

# A template that reads what a tool-calling request carries beyond its messages: the tools (as
# JSON), documents, an assistant's tool calls (arguments as JSON), a tool's call id, and a kwarg
# (enable_thinking), so the router's rendering of each shows in the text.
TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}{% for t in tools %}{{ t | tojson }}{{ '\\n' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% if documents %}{% for d in documents %}{{ 'doc ' + d.title + ': ' + d.text + '\\n' }}{% endfor %}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{% for c in message.tool_calls or [] %}{{ c.id + ' ' + c.function.name + ' ' + (c.function.arguments | tojson) }}"
    "{% endfor %}{% if message.tool_call_id %}{{ ' for ' + message.tool_call_id }}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ 'a b\\n' }}{% endif %}{% endif %}"
)
