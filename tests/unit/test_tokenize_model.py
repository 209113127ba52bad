"""The router's model tokenizer: the chat template and encoding as vLLM applies them, the bounded
head, the configuration's checks, and the thread pool's deadline (a late tokenization falls back
to prefix affinity, counted)."""

from __future__ import annotations

import asyncio
import random
import sys
import threading

import pytest

from llmgw.config import ConfigInvalid
from llmgw.kvroutekeys import chain_keys, to_hex
from llmgw.router.balancing import ByModel, CacheAware, PrefixAffinity, Tokenized, make_balancer
from llmgw.router.kvindex import KVIndex
from llmgw.router.settings import RouterSettings
from llmgw.router.tokenize_model import ModelTokenizer, TokenizerSourceError, Unrenderable, read_source
from llmgw.router.tokenize_parity import REJECTED, compare
from llmgw.router.tokenize_pool import TokenizePool
from tests.support.tinytokenizer import TEMPLATE, VOCAB, WORDS, model_dir
from tests.support.scorermembers import Ep, Member

def ids(*tokens: str) -> list[int]:
    return [VOCAB[t] for t in tokens]


BASE = {"listen": {"port": 1}, "allow_unauthenticated": True, "insecure_http": True}
CP = {"url": "https://cp:1", "ca": "/ca", "cert": "/c", "key": "/k"}
CHAT = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]}


def test_chat_is_rendered_with_the_generation_prompt_and_encoded_without_bos(tmp_path):
    tok = ModelTokenizer.from_directory(str(model_dir(tmp_path)))
    assert tok.render_chat(CHAT["messages"]) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n")
    assert tok.token_ids(CHAT, 100) == ids("<|im_start|>", "system", "be", "brief", "<|im_end|>", "<|im_start|>",
                                           "user", "hi", "there", "<|im_end|>", "<|im_start|>", "assistant")
    # text parts are joined by newlines, as vLLM's "string" content format does
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}],
             "add_generation_prompt": False}
    assert tok.token_ids(parts, 100) == ids("<|im_start|>", "user", "hi", "there", "<|im_end|>")
    with pytest.raises(Unrenderable):
        tok.token_ids({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 9)


def test_a_completion_prompt_gets_bos_as_the_tokenizer_says(tmp_path):
    tok = ModelTokenizer.from_directory(str(model_dir(tmp_path)))
    assert tok.token_ids({"prompt": "hi there"}, 100) == ids("<s>", "hi", "there")
    assert tok.token_ids({"prompt": ["hi there", "a"]}, 100) == ids("<s>", "hi", "there")  # a batch: the first
    off = ModelTokenizer.from_directory(str(model_dir(tmp_path, {"bos_token": "<s>", "add_bos_token": False})))
    assert off.token_ids({"prompt": "hi there"}, 100) == ids("hi", "there")


def test_only_a_bounded_head_is_encoded_and_its_ids_are_the_full_encodings(tmp_path):
    tok = ModelTokenizer.from_directory(str(model_dir(tmp_path)))
    rng = random.Random(7)
    text = " ".join(rng.choice(WORDS) + " " * rng.randint(0, 3) for _ in range(5000))
    dense = " ".join(rng.choice("abcdefgh") for _ in range(20000))  # 2 characters a token: the first head suffices
    for t in (text, dense):
        full = tok.token_ids({"prompt": t}, 10**6)
        for n in (16, 100, 777):
            assert tok.token_ids({"prompt": t}, n) == full[:n]


def test_settings_name_the_broken_tokenizer_source_by_pointer(tmp_path, monkeypatch):
    good = model_dir(tmp_path)
    base = {**BASE, "control_plane": CP}

    def errors(model_tokenizers: dict, models=("m", "n/x")) -> dict[str, str]:
        doc = {**base, "balancing": {"cache_aware": {"models": list(models), "model_tokenizers": model_tokenizers}}}
        with pytest.raises(ConfigInvalid) as e:
            RouterSettings.from_config(doc)
        return {err.pointer: err.message for err in e.value.errors}

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{not json")
    got = errors({"m": str(tmp_path / "absent"), "n/x": str(bad), "other": str(good)})
    assert "not a directory" in got["/balancing/cache_aware/model_tokenizers/m"]
    assert "not JSON" in got["/balancing/cache_aware/model_tokenizers/n~1x"]
    assert "not in balancing.cache_aware.models" in got["/balancing/cache_aware/model_tokenizers/other"]
    (bad / "tokenizer.json").write_text('{"model": {"type": "NoSuchModel"}}')
    assert "cannot be loaded" in errors({"m": str(bad)})["/balancing/cache_aware/model_tokenizers/m"]
    (good / "chat_template.jinja").write_text("{% for %}")
    assert "does not compile" in errors({"m": str(good)})["/balancing/cache_aware/model_tokenizers/m"]
    (good / "chat_template.jinja").write_text(TEMPLATE)
    (bad / "tokenizer.json").unlink()
    assert "tokenizer.json: missing" in errors({"m": str(bad)})["/balancing/cache_aware/model_tokenizers/m"]
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # a router host without the extra
    assert "install llmgw[router-tokenize]" in errors({"m": str(good)})["/balancing/cache_aware/model_tokenizers"]


def test_read_source_takes_the_inline_template_when_there_is_no_jinja_file(tmp_path):
    d = model_dir(tmp_path, {"bos_token": {"content": "<s>"}, "chat_template": [{"name": "default", "template": "T"}]},
                  template=None)
    files = read_source(str(d))
    assert files.chat_template == "T" and files.special_tokens == {"bos_token": "<s>"}
    (d / "tokenizer_config.json").write_text("[]")
    with pytest.raises(TokenizerSourceError, match="not a JSON object"):
        read_source(str(d))


BS = 4


def aware(tok, pool, seen, index) -> CacheAware:
    return CacheAware(index, None, BS, 1000, PrefixAffinity(256, 1.25, random.Random(1)), clock=lambda: 1.0,
                      model_tokenizer=tok, pool=pool, on_fallback=seen.append)


def test_ids_from_the_pool_route_precisely_and_a_late_one_falls_back_counted(tmp_path):
    tok = ModelTokenizer.from_directory(str(model_dir(tmp_path)))
    keys = chain_keys(tok.token_ids(CHAT, 1000), BS)
    assert len(keys) == 3
    index = KVIndex(stale_after=10)
    index.apply({"epoch": "e", "revision": 1, "full": True, "replicas": [
        {"replica_id": "r0", "reset": True, "added": []},
        {"replica_id": "r1", "reset": True, "added": [to_hex(k) for k in keys]}]}, 1.0)
    ms = [Member("e0", Ep("m", "r0")), Member("e1", Ep("m", "r1"))]
    seen: list[str] = []

    async def main() -> None:
        pool = TokenizePool(1, 0.05)
        s = aware(tok, pool, seen, index)
        payload = await s.prepare(ms, CHAT)
        assert isinstance(payload, Tokenized) and payload == CHAT
        assert s.pick(ms, lambda m: True, payload) is ms[1] and s.precise == 1
        # without prepared ids the real tokenizer never runs inline: prefix affinity
        s.pick(ms, lambda m: True, CHAT)
        assert (s.precise, s.fell_back) == (1, 1)

        release = threading.Event()

        class Stuck:
            def token_ids(self, payload, n):
                release.wait(5)
                return tok.token_ids(payload, n)

        slow = aware(Stuck(), pool, seen, index)
        late = await slow.prepare(ms, CHAT)
        assert late.token_ids is None and seen == ["timeout"]
        slow.pick(ms, lambda m: True, late)
        assert (slow.precise, slow.fell_back) == (0, 1)
        release.set()
        pool.close()

    asyncio.run(main())


def test_a_model_off_for_parity_is_not_tokenized_and_routes_by_affinity(tmp_path):
    tok = ModelTokenizer.from_directory(str(model_dir(tmp_path)))
    index = KVIndex(stale_after=10)
    index.apply({"epoch": "e", "revision": 1, "full": True, "replicas": [
        {"replica_id": "r0", "reset": True, "added": [to_hex(k) for k in chain_keys(tok.token_ids(CHAT, 99), BS)]}]},
        1.0)
    ms = [Member("e0", Ep("m", "r0")), Member("e1", Ep("m", "r1"))]

    async def main() -> None:
        pool = TokenizePool(1, 1.0)
        s = aware(tok, pool, [], index)
        s.disable("test")
        payload = await s.prepare(ms, CHAT)
        assert payload is CHAT  # nothing submitted
        s.pick(ms, lambda m: True, payload)
        assert (s.precise, s.fell_back) == (0, 1)
        pool.close()

    asyncio.run(main())


def test_make_balancer_gives_listed_models_their_own_tokenizer(tmp_path):
    d = model_dir(tmp_path)
    s = RouterSettings.from_config({**BASE, "control_plane": CP,
                                    "balancing": {"cache_aware": {"models": ["real", "sim"],
                                                                  "model_tokenizers": {"real": str(d)}}}})
    b = make_balancer(s.balancing, KVIndex(stale_after=10))
    assert isinstance(b, ByModel)
    assert b.scorers["real"].model_tokenizer is not None and b.scorers["real"].tokenize is None
    assert b.scorers["sim"].model_tokenizer is None and b.scorers["sim"].tokenize is not None


def test_parity_compare_names_the_first_difference():
    assert compare([[1, 2], [3]], [[1, 2], [3]]).ok
    v = compare([[1, 2, 3]], [[1, 2, 4]])
    assert not v.ok and "position 2" in v.reason
    assert "no usable /tokenize" in compare([[1]], [None]).reason
    # a template that refuses a canned conversation (roles must alternate, no system role) on both sides
    assert compare([REJECTED, [1]], [REJECTED, [1]]).ok
    assert "only the engine refuses" in compare([[1]], [REJECTED]).reason
    assert "only the router's chat template refuses" in compare([REJECTED], [[1]]).reason
    assert "nothing could be compared" in compare([REJECTED], [REJECTED]).reason
