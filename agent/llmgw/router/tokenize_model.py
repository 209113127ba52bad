"""A model's own tokenizer in the router: the token ids vLLM's OpenAI server makes of a request.

Route keys are digests of token ids, so a router that tokenizes a prompt differently from the
engine computes keys no engine ever publishes and every request falls back. What vLLM does
(``vllm/entrypoints/serve/tokenize/protocol.py`` and its renderers, 0.32):

- ``/v1/chat/completions``: the chat template is rendered with ``add_generation_prompt`` (true
  unless the request says otherwise) and the tokenizer's special tokens as variables, in the
  sandboxed Jinja environment HF ``transformers`` uses (``trim_blocks``, ``lstrip_blocks``,
  ``loopcontrols``, its ``tojson``, ``raise_exception``, ``strftime_now``); the text is then
  encoded *without* special tokens (the template wrote them);
- ``/v1/completions``: the prompt string encoded *with* special tokens, i.e. the tokenizer's
  post-processor (BOS where ``tokenizer.json`` or ``add_bos_token`` says).

The source is a model directory on the router host: ``tokenizer.json``, optional
``tokenizer_config.json`` (special tokens, ``add_bos_token``, an inline ``chat_template``) and
``chat_template.jinja`` (which wins, as in ``transformers``). A request whose messages the
router cannot render as vLLM would (non-text parts, a template error) gets no ids: prefix
affinity routes it. Only a bounded head of the text is encoded (``max_tokens`` ids), so the
cost per request stays bounded whatever the prompt's length. Pure: no event loop here; the
router runs ``token_ids`` in ``tokenize_pool``'s threads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

EXTRA = "router-tokenize"  # pyproject's optional dependencies for this module
HEAD_CHARS_PER_TOKEN = 4  # characters encoded per wanted token at first: enough for most text
CHARS_PER_TOKEN_BOUND = 16  # and at most: a head that still falls short is keyed as far as it goes
TAIL_MARGIN = 256  # characters before a cut whose tokens cannot be trusted (a word split at the cut)


class TokenizerSourceError(Exception):
    """The tokenizer source cannot be used; the message names the file and why."""


@dataclass(frozen=True)
class TokenizerFiles:
    tokenizer_json: str  # the file's text
    chat_template: str | None
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token etc., the template's variables
    add_bos_token: bool | None = None  # tokenizer_config.json's override of the post-processor, if any


def _token_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):  # an AddedToken written out
        return v["content"]
    return None


def _read_json(path: Path) -> tuple[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise TokenizerSourceError(f"{path}: cannot be read: {e.strerror or e}") from None
    try:
        return text, json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise TokenizerSourceError(f"{path}: not JSON: {e}") from None


def read_source(directory: str) -> TokenizerFiles:
    """The tokenizer files of the model directory ``directory``; ``TokenizerSourceError`` naming what is wrong."""
    d = Path(directory)
    if not d.is_dir():
        raise TokenizerSourceError(f"{directory}: not a directory (want a model directory with tokenizer.json)")
    tj = d / "tokenizer.json"
    if not tj.is_file():
        raise TokenizerSourceError(f"{tj}: missing (the router needs the model's tokenizer.json)")
    tj_text, doc = _read_json(tj)
    if not isinstance(doc, dict) or "model" not in doc:
        raise TokenizerSourceError(f"{tj}: not a tokenizers file (no \"model\")")
    config: dict[str, Any] = {}
    tc = d / "tokenizer_config.json"
    if tc.exists():
        _, c = _read_json(tc)
        if not isinstance(c, dict):
            raise TokenizerSourceError(f"{tc}: not a JSON object")
        config = c
    template: str | None = None
    jinja = d / "chat_template.jinja"
    if jinja.exists():
        try:
            template = jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerSourceError(f"{jinja}: cannot be read: {e}") from None
    else:
        t = config.get("chat_template")
        if isinstance(t, list):  # named templates: the default one, as transformers picks
            t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
        template = t if isinstance(t, str) else None
    special = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        text = _token_text(config.get(name))
        if text is not None:
            special[name] = text
    add_bos = config.get("add_bos_token")
    return TokenizerFiles(tj_text, template, special, add_bos if isinstance(add_bos, bool) else None)


def _compile_template(source: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise TokenizerSourceError(f"chat template does not compile: {e}") from None


class Unrenderable(Exception):
    """A request the router cannot tokenize as the engine would."""


def conversation(messages: Any) -> list[dict[str, Any]]:
    """``messages`` as vLLM hands them to the template: text parts joined by newlines (its "string"
    content format); anything else (images, audio) is not the router's to guess."""
    if not isinstance(messages, list) or not messages:
        raise Unrenderable("messages is not a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise Unrenderable("a message without a role")
        c = m.get("content")
        if isinstance(c, list):
            texts = []
            for part in c:
                if isinstance(part, str):
                    texts.append(part)
                elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                else:
                    raise Unrenderable("a message part that is not text")
            c = "\n".join(texts)
        elif c is not None and not isinstance(c, str):
            raise Unrenderable("message content that is not text")
        out.append({**m, "content": c})
    return out


class ModelTokenizer:
    """One model's tokenizer and chat template; ``token_ids`` is thread-safe (the Rust tokenizer is)."""

    def __init__(self, files: TokenizerFiles) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerSourceError(f"the tokenizers package is not installed: install llmgw[{EXTRA}]") from None
        try:
            self.tokenizer = Tokenizer.from_str(files.tokenizer_json)
        except Exception as e:  # the library raises a bare Exception for a file it cannot build from
            raise TokenizerSourceError(f"tokenizer.json cannot be loaded: {e}") from None
        self.template = _compile_template(files.chat_template) if files.chat_template is not None else None
        self.special = dict(files.special_tokens)
        self.add_bos = files.add_bos_token
        bos = files.special_tokens.get("bos_token")
        self.bos_id = self.tokenizer.token_to_id(bos) if bos is not None else None

    @classmethod
    def from_directory(cls, directory: str) -> "ModelTokenizer":
        return cls(read_source(directory))

    def render_chat(self, messages: Any, add_generation_prompt: bool = True) -> str:
        if self.template is None:
            raise Unrenderable("the model has no chat template")
        import jinja2

        try:
            return self.template.render(messages=conversation(messages), add_generation_prompt=add_generation_prompt,
                                        **self.special)
        except jinja2.exceptions.TemplateError as e:
            raise Unrenderable(f"chat template: {e}") from None

    def encode(self, text: str, add_special_tokens: bool, max_tokens: int) -> list[int]:
        """The first ``max_tokens`` ids of ``text``, encoding only a bounded head of it: first
        ``HEAD_CHARS_PER_TOKEN`` characters per wanted id, then, if that head was too short, a
        ``CHARS_PER_TOKEN_BOUND`` one."""
        for per_token in (HEAD_CHARS_PER_TOKEN, CHARS_PER_TOKEN_BOUND):
            ids, cut = self._encode_head(text, add_special_tokens, max_tokens * per_token + TAIL_MARGIN)
            if not cut or len(ids) >= max_tokens:
                break
        if add_special_tokens and self.add_bos is not None and self.bos_id is not None:
            if self.add_bos and (not ids or ids[0] != self.bos_id):
                ids.insert(0, self.bos_id)
            elif not self.add_bos and ids and ids[0] == self.bos_id and not text.startswith(self.special["bos_token"]):
                ids.pop(0)
        return ids[:max_tokens]

    def _encode_head(self, text: str, add_special_tokens: bool, limit: int) -> tuple[list[int], bool]:
        cut = len(text) > limit
        enc = self.tokenizer.encode(text[:limit] if cut else text, add_special_tokens=add_special_tokens)
        ids = list(enc.ids)
        if cut:  # a token reaching into the last characters before the cut may be a word split in two
            keep = limit - TAIL_MARGIN
            n = 0
            for (_start, end), special in zip(enc.offsets, enc.special_tokens_mask):
                if end > keep and not special:
                    break
                n += 1
            ids = ids[:n]
        return ids, cut

    def token_ids(self, payload: dict[str, Any] | None, max_tokens: int) -> list[int]:
        """The first ``max_tokens`` ids the engine makes of this request; ``Unrenderable`` when the router cannot say."""
        if not payload:
            raise Unrenderable("no payload")
        if "messages" in payload:
            agp = payload.get("add_generation_prompt", True)
            text = self.render_chat(payload["messages"], bool(agp))
            return self.encode(text, bool(payload.get("add_special_tokens", False)), max_tokens)
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]  # a batch: the first prompt decides
        if isinstance(prompt, str):
            return self.encode(prompt, bool(payload.get("add_special_tokens", True)), max_tokens)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):  # already token ids
            return list(prompt[:max_tokens])
        raise Unrenderable("no prompt the router can tokenize")
