"""A model's own tokenizer in the router: the token ids vLLM's OpenAI server makes of a request.

Route keys are digests of token ids, so a router that tokenizes a prompt differently from the
engine computes keys no engine ever publishes and every request falls back. What vLLM does
(``vllm/entrypoints/openai/chat_completion/protocol.py``, ``vllm/renderers/online_renderer.py``,
``vllm/renderers/hf.py``, ``vllm/renderers/chat_utils``; read at 0.33.0, checked against a live
0.32.0):

- ``/v1/chat/completions``: the messages are rebuilt as vLLM's parser rebuilds them
  (``conversation``), the request's ``tools``, ``documents`` and ``chat_template_kwargs`` become
  template variables as vLLM merges them (``render_kwargs``), and the chat template is rendered
  with them, ``add_generation_prompt`` (true unless the request says otherwise) and the
  tokenizer's special tokens, in the sandboxed Jinja environment HF ``transformers`` uses
  (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, its ``tojson``, ``raise_exception``,
  ``strftime_now``), cut for ``continue_final_message`` as ``transformers`` cuts it; the text is
  then encoded *without* special tokens (the template wrote them);
- ``/v1/completions``: the prompt string encoded *with* special tokens, i.e. the tokenizer's
  post-processor (BOS where ``tokenizer.json`` or ``add_bos_token`` says).

The source is a model directory on the router host: ``tokenizer.json``, optional
``tokenizer_config.json`` (special tokens, ``add_bos_token``, an inline ``chat_template``) and
``chat_template.jinja`` (which wins, as in ``transformers``). A request the router cannot
render as vLLM would gets no ids (``Unrenderable``): prefix affinity routes it. That is a
request with non-text parts, a template error, its own ``chat_template``, a
``reasoning_effort`` the template reads (the engine's ``--reasoning-effort-map`` is not the
router's to know), ``tool_choice: "none"`` beside tools (whether the engine drops them is its
``--exclude-tools-when-tool-choice-none``), or anything vLLM would refuse with a 400. Only a
bounded head of the text is encoded (``max_tokens`` ids), so the cost per request stays bounded
whatever the prompt's length. Pure: no event loop here; the
router runs ``token_ids`` in ``tokenize_pool``'s threads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping

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
    tool_use_template: str | None = None  # the named "tool_use" one, which transformers takes for tools


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
    tool_use: str | None = None
    jinja = d / "chat_template.jinja"
    if jinja.exists():
        template = _read_text(jinja)
        extra = d / "additional_chat_templates" / "tool_use.jinja"
        tool_use = _read_text(extra) if extra.exists() else None
    else:
        t = config.get("chat_template")
        if isinstance(t, list):  # named templates: the default one, as transformers picks (tool_use for tools)
            named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
            t = named.get("default")
            tool_use = named.get("tool_use") if isinstance(named.get("tool_use"), str) else None
        template = t if isinstance(t, str) else None
    special = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        text = _token_text(config.get(name))
        if text is not None:
            special[name] = text
    add_bos = config.get("add_bos_token")
    return TokenizerFiles(tj_text, template, special, add_bos if isinstance(add_bos, bool) else None, tool_use)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerSourceError(f"{path}: cannot be read: {e}") from None


def _compile_template(source: str) -> tuple[Any, frozenset[str]]:
    """The compiled template and the variables it reads (vLLM's ``resolve_chat_template_kwargs``
    keeps only those of a request's ``chat_template_kwargs``)."""
    import jinja2
    import jinja2.ext
    import jinja2.meta
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
        return env.from_string(source), frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
    except jinja2.exceptions.TemplateError as e:
        raise TokenizerSourceError(f"chat template does not compile: {e}") from None


class Unrenderable(Exception):
    """A request the router cannot tokenize as the engine would."""


@dataclass(frozen=True)
class EngineChatSettings:
    """The engine's flags that change what a chat request renders to, where the router was told
    them; None: not known, and a request they would decide is ``Unrenderable``."""
    exclude_tools_when_tool_choice_none: bool | None = None  # vLLM's --exclude-tools-when-tool-choice-none
    reasoning_effort_map: Mapping[str, str] | None = None  # vLLM's --reasoning-effort-map ({} when unset)


# transformers' ``apply_chat_template`` parameters: named arguments, not template variables, so a
# request's ``chat_template_kwargs`` entry of that name changes how it renders or tokenizes (or is
# refused), which the router does not model; ``add_generation_prompt`` and
# ``continue_final_message`` are always overridden by the request's own fields, ``documents`` is
# taken as the request's. ``messages`` would clash with the render call's own argument (vLLM 400).
UNMODELLED_KWARGS = frozenset({"conversation", "tools", "chat_template", "tokenize", "padding", "truncation",
                               "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                               "tokenizer_kwargs", "messages"})
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for the end of the continued message
BILLING_HEADER = "x-anthropic-billing-header"  # vLLM drops this line from system text (it changes every request)


def _text(role: str, content: Any) -> str:
    """A message's content as vLLM's "string" format makes it (``parse_chat_message_content``):
    none is "", text parts are joined by newlines, empty ones left out; a system part's billing
    header line is dropped. Anything else (images, audio) is not the router's to guess."""
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [content]
    elif isinstance(content, list):
        parts = [p["text"] if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                 else p for p in content]
        if not all(isinstance(p, str) for p in parts):
            raise Unrenderable("a message part that is not text")
    else:
        raise Unrenderable("message content that is not text")
    if role == "system":
        parts = [p.partition("\n")[2] if p.startswith(BILLING_HEADER) else p for p in parts]
    return "\n".join(p for p in parts if p)


def _tool_call(item: Any) -> dict[str, Any]:
    """An assistant's tool call as vLLM hands it to the template: validated as OpenAI's
    ``ChatCompletionMessageFunctionToolCallParam`` (its keys, in its order), the ``arguments``
    string parsed to an object, {} when empty, not JSON or not an object
    (``chat_utils._postprocess_messages``: templates expect a mapping)."""
    f = item.get("function") if isinstance(item, dict) else None
    if (not isinstance(f, dict) or item.get("type") != "function" or not isinstance(item.get("id"), str)
            or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str)):
        raise Unrenderable("a tool call vLLM would refuse")
    try:
        args = json.loads(f["arguments"]) if f["arguments"] else {}
    except ValueError:
        args = {}
    return {"id": item["id"], "function": {"arguments": args if isinstance(args, dict) else {}, "name": f["name"]},
            "type": "function"}


def _message(m: Any) -> dict[str, Any]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise Unrenderable("a message without a role")
    role = m["role"]
    out: dict[str, Any] = {"role": role, "content": _text(role, m.get("content"))}
    if role == "assistant":
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise Unrenderable("tool_calls is not a list")
            if calls:  # an empty list is dropped: the template takes the plain assistant path
                out["tool_calls"] = [_tool_call(c) for c in calls]
        reasoning = m.get("reasoning")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise Unrenderable("reasoning that is not text")
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in m:
        if not isinstance(m["tool_call_id"], (str, type(None))):
            raise Unrenderable("a tool_call_id that is not text")
        out["tool_call_id"] = m["tool_call_id"]
    for key in ("name", "task"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    if role == "developer":
        if m.get("tools") is not None:
            raise Unrenderable("a developer message with tools")
        out["tools"] = None
    return out


def conversation(messages: Any, developer_role: bool = True) -> list[dict[str, Any]]:
    """``messages`` as vLLM hands them to the template (``chat_utils.parse_chat_message_content``):
    each rebuilt from the keys it reads (content as text, an assistant's tool calls and reasoning,
    a tool's call id, a name), others dropped. ``developer_role`` false (the template never names
    it): developer messages become system ones, merged into one first message
    (``hf._convert_developer_to_system``, ``_consolidate_system_messages``)."""
    if not isinstance(messages, list) or not messages:
        raise Unrenderable("messages is not a non-empty list")
    out = [_message(m) for m in messages]
    if developer_role or not any(m["role"] == "developer" for m in out):
        return out
    out = [{k: v for k, v in {**m, "role": "system"}.items() if k != "tools"} if m["role"] == "developer" else m
           for m in out]
    if [i for i, m in enumerate(out) if m["role"] == "system"] == [0]:
        return out
    merged = {"role": "system",
              "content": "\n\n".join(m["content"] for m in out if m["role"] == "system" and m["content"])}
    return [merged, *(m for m in out if m["role"] != "system")]


def _optional(d: dict[str, Any], key: str, kind: type) -> Any:
    v = d.get(key)
    if v is not None and not isinstance(v, kind):
        raise Unrenderable(f"a tool's {key} vLLM would refuse")
    return v


def tool_dicts(tools: Any) -> list[dict[str, Any]]:
    """``tools`` as vLLM passes them to the template: each validated as its
    ``ChatCompletionToolsParam`` and ``model_dump()``-ed (``online_renderer.render_chat``), which
    keeps ``description`` and ``parameters`` when null (``tojson`` prints them) but leaves out a
    null ``strict`` or ``defer_loading`` and every key it does not know
    (``entrypoints/generate/base/protocol.py``'s serializers)."""
    if not isinstance(tools, list) or not tools:
        raise Unrenderable("tools is not a non-empty list")  # the chat route refuses []
    out = []
    for t in tools:
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(f, dict) or t.get("type", "function") != "function" or not isinstance(f.get("name"), str):
            raise Unrenderable("a tool vLLM would refuse")
        fn = {"name": f["name"], "description": _optional(f, "description", str),
              "parameters": _optional(f, "parameters", dict)}
        strict, defer = _optional(f, "strict", bool), _optional(f, "defer_loading", bool)
        outer = _optional(t, "defer_loading", bool)
        if strict is not None:
            fn["strict"] = strict
        if (defer if defer is not None else outer) is not None:  # the tool's defer_loading reaches its function
            fn["defer_loading"] = defer if defer is not None else outer
        out.append({"type": "function", "function": fn, **({"defer_loading": outer} if outer is not None else {})})
    return out


def _merge(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``renderers.params.merge_kwargs``: an override of None or "auto" leaves the default."""
    return defaults | {k: v for k, v in overrides.items() if v is not None and v != "auto"}


def render_kwargs(payload: dict[str, Any], variables: frozenset[str],
                  engine: EngineChatSettings = EngineChatSettings()) -> dict[str, Any]:
    """The arguments of transformers' render for a ``/v1/chat/completions`` body, merged as vLLM
    merges them (``ChatCompletionRequest.build_chat_params``, then ``ChatParams.with_defaults``
    with the tools; ``online_renderer.preprocess_chat``): ``chat_template_kwargs`` first, the
    request's ``add_generation_prompt``, ``continue_final_message``, ``documents`` and
    ``reasoning_effort`` over them. ``tools``, ``documents``, ``add_generation_prompt`` and
    ``continue_final_message`` are returned for ``ModelTokenizer.render_chat``; the rest are
    template variables. ``variables``: those the template reads, which decide whether an unknown
    engine flag matters."""
    if payload.get("chat_template") is not None:
        raise Unrenderable("the request's own chat_template")  # refused without --trust-request-chat-template
    agp, cont = payload.get("add_generation_prompt", True), payload.get("continue_final_message", False)
    if not isinstance(agp, bool) or not isinstance(cont, bool) or (agp and cont):
        raise Unrenderable("add_generation_prompt and continue_final_message vLLM would refuse")
    user = payload.get("chat_template_kwargs") or {}
    if not isinstance(user, dict) or not all(isinstance(k, str) for k in user):
        raise Unrenderable("chat_template_kwargs is not an object")
    if UNMODELLED_KWARGS & user.keys():
        raise Unrenderable(f"chat_template_kwargs {sorted(UNMODELLED_KWARGS & user.keys())}")
    docs = payload.get("documents")
    if docs is not None and not (isinstance(docs, list) and all(
            isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in docs)):
        raise Unrenderable("documents that are not a list of objects of text")
    effort = payload.get("reasoning_effort")
    extra: dict[str, Any] = {"add_generation_prompt": agp, "continue_final_message": cont, "documents": docs}
    if effort is not None:
        reads = {"reasoning_effort"} | ({"enable_thinking"} if "enable_thinking" not in user else set())
        if variables & reads:
            if engine.reasoning_effort_map is None:
                raise Unrenderable("reasoning_effort: the engine's --reasoning-effort-map is not known")
            effort = engine.reasoning_effort_map.get(effort, effort)
            extra["reasoning_effort"] = effort
            if "enable_thinking" not in user:
                extra["enable_thinking"] = effort != "none"
    tools = request_tools(payload, engine)
    kw = _merge({"tools": tools} if tools is not None else {}, _merge(user, extra))
    if kw.get("documents") is not None and not (
            isinstance(kw["documents"], list) and all(isinstance(d, dict) for d in kw["documents"])):
        raise Unrenderable("documents that are not a list of objects")  # transformers' TypeError
    return kw


def request_tools(payload: dict[str, Any],
                  engine: EngineChatSettings = EngineChatSettings()) -> list[dict[str, Any]] | None:
    """The tools the template gets: none with ``tool_choice: "none"`` where the engine runs with
    ``--exclude-tools-when-tool-choice-none`` (``online_renderer.render_chat``); a request with
    tools and no ``tool_choice`` is "auto" (``ChatCompletionRequest.check_tool_usage``)."""
    tools = payload.get("tools")
    if tools is None:
        return None
    if payload.get("tool_choice", "auto") == "none":
        if engine.exclude_tools_when_tool_choice_none is None:
            raise Unrenderable("tool_choice none: the engine's --exclude-tools-when-tool-choice-none is not known")
        if engine.exclude_tools_when_tool_choice_none:
            return None
    return tool_dicts(tools)


def _cut_at_continue_tag(text: str, final: str) -> str:
    """transformers' ``continue_final_message`` (``render_jinja_template``, 5.x): the final message
    was rendered with a marker appended; the text ends where the marker began (trailing spacing the
    template trimmed, trimmed too)."""
    if final.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise Unrenderable("continue_final_message: the template drops the final message")
    at = text.rindex(CONTINUE_TAG.strip())
    return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


class ModelTokenizer:
    """One model's tokenizer and chat template; ``token_ids`` is thread-safe (the Rust tokenizer is)."""

    def __init__(self, files: TokenizerFiles, engine: EngineChatSettings = EngineChatSettings()) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerSourceError(f"the tokenizers package is not installed: install llmgw[{EXTRA}]") from None
        try:
            self.tokenizer = Tokenizer.from_str(files.tokenizer_json)
        except Exception as e:  # the library raises a bare Exception for a file it cannot build from
            raise TokenizerSourceError(f"tokenizer.json cannot be loaded: {e}") from None
        self.sources = {name: text for name, text in (("default", files.chat_template),
                                                      ("tool_use", files.tool_use_template)) if text is not None}
        self.templates = {name: _compile_template(text) for name, text in self.sources.items()}
        self.engine = engine
        self.special = dict(files.special_tokens)
        self.add_bos = files.add_bos_token
        bos = files.special_tokens.get("bos_token")
        self.bos_id = self.tokenizer.token_to_id(bos) if bos is not None else None

    @classmethod
    def from_directory(cls, directory: str, engine: EngineChatSettings = EngineChatSettings()) -> "ModelTokenizer":
        return cls(read_source(directory), engine)

    def render_chat(self, messages: Any, add_generation_prompt: bool = True, **request: Any) -> str:
        """The text vLLM renders for a chat request: ``messages``, ``add_generation_prompt`` and the
        body's other fields (``tools``, ``tool_choice``, ``documents``, ``chat_template_kwargs``,
        ``continue_final_message``, ``reasoning_effort``, ``chat_template``) as ``render_kwargs``
        reads them. With tools, a named ``tool_use`` template is transformers' choice
        (``get_chat_template``)."""
        with_tools = request_tools(request, self.engine) is not None
        name = "tool_use" if with_tools and "tool_use" in self.templates else "default"
        if name not in self.templates:
            raise Unrenderable("the model has no chat template")
        template, variables = self.templates[name]
        kw = render_kwargs({**request, "add_generation_prompt": add_generation_prompt}, variables, self.engine)
        developer = '"developer"' in self.sources[name] or "'developer'" in self.sources[name]
        chat = conversation(messages, developer)
        cont = kw.pop("continue_final_message", False)
        if cont:
            if "content" not in self.sources[name]:
                raise Unrenderable("continue_final_message: the template has no content field")
            final = chat[-1]["content"]
            chat = [*chat[:-1], {**chat[-1], "content": final + CONTINUE_TAG}]
        fixed = {k: kw.pop(k, None) for k in ("tools", "documents")}
        fixed["add_generation_prompt"] = kw.pop("add_generation_prompt")
        try:
            text = template.render(messages=chat, **fixed, **{**self.special, **kw})
        except Exception as e:  # vLLM answers 400 to whatever the template raises (hf.safe_apply_chat_template)
            raise Unrenderable(f"chat template: {type(e).__name__}: {e}") from None
        return _cut_at_continue_tag(text, final) if cont else text

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
            request = {k: v for k, v in payload.items() if k != "messages"}
            text = self.render_chat(payload["messages"], **request)
            return self.encode(text, bool(payload.get("add_special_tokens", False)), max_tokens)
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]  # a batch: the first prompt decides
        if isinstance(prompt, str):
            return self.encode(prompt, bool(payload.get("add_special_tokens", True)), max_tokens)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):  # already token ids
            return list(prompt[:max_tokens])
        raise Unrenderable("no prompt the router can tokenize")
