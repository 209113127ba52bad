"""The shape of vLLM's ``kv_transfer_params`` that a disaggregating router carries (NIXL connector).

Prefill/decode disaggregation with vLLM runs in two phases through the router: the request
goes to a prefill engine with ``kv_transfer_params = {"do_remote_decode": true, ...}``
(``stream=false``, ``max_tokens=1``); that engine answers with its own ``kv_transfer_params``
(where its KV blocks are and how to reach it), which the router forwards verbatim on the
original request to a decode engine, whose NIXL connector pulls the blocks. The router never
interprets the blocks, but it must know which keys the decode side cannot do without: an
answer that lacks one makes the decode engine fail the request (a ``KeyError`` in its
scheduler is an HTTP 500) or, when ``do_remote_prefill`` is not true, silently prefill the
whole prompt again, which hides a broken transfer behind a slow one. :func:`check_prefill_params`
lets the router refuse such an answer and fall back to a local prefill instead.

The lists below are what the NIXL connector's scheduler reads from a request's
``kv_transfer_params`` (``vllm/distributed/kv_transfer/kv_connector/v1/nixl/{base_scheduler,
metadata,pull_scheduler,push_scheduler}.py``): a key read as ``params["k"]`` is required, one
read as ``params.get("k")`` is optional. vLLM changed this schema under its users before (its
``NIXL_CONNECTOR_VERSION`` history: ``remote_request_id`` in 2, ``remote_blocks_expiry_time`` in
5, ``remote_registration_generation`` in 15), so ``tests/unit/test_kvtransfer_drift.py`` reads
the pinned vLLM source and the installed CPU build statically and fails, naming the key, when
a release adds a required key or renames one. The lists follow the pinned release (vLLM 0.33,
connector version 15); :data:`OPTIONAL_SINCE` records what older releases lack.

Pure logic: no I/O here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# NIXL_CONNECTOR_VERSION of the pinned vLLM (metadata.py). Prefill and decode engines refuse
# each other's handshake unless a hash of (among others) the vLLM version, this version and
# the transfer mode matches, so a disaggregated pair must run one vLLM release; the router
# itself only forwards the parameters.
NIXL_CONNECTOR_VERSION = 15

# What the router puts in the prefill request's kv_transfer_params: "compute the prompt's KV
# and hold the blocks for a remote decoder" (do_remote_decode), "not a decode of a remote
# prefill" (do_remote_prefill). vLLM reads both with .get(): a missing flag means False.
PREFILL_REQUEST = {"do_remote_decode": True, "do_remote_prefill": False}
REQUEST_FLAGS = tuple(PREFILL_REQUEST)

# Keys the decode side subscripts: where the prefilled blocks are and which engine holds them.
# tp_size is subscripted only by the push mode, yet every prefill answer carries it and the
# pull mode's lease heartbeats are skipped without it, so it is required here too.
REQUIRED_KEYS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host",
                 "remote_port", "tp_size")

# Keys read with .get(), and whether vLLM tolerates an explicit null (those read with a
# default, e.g. .get("pp_size", 1), do not: a present null replaces the default).
OPTIONAL_KEYS = {
    "dcp_size": False,
    "pp_size": False,
    "remote_block_size": True,
    "remote_num_tokens": True,
    "remote_blocks_expiry_time": True,
    "remote_registration_generation": False,
}

# The NIXL connector version that introduced an optional key; releases before it never read it.
OPTIONAL_SINCE = {"remote_registration_generation": 15}

# Keys the prefill answer carries that no scheduler reads (informational: the engine's mode).
ANSWER_ONLY_KEYS = ("transfer_mode",)

# Marks vLLM writes into a request's own params while scheduling it; a router never sets them.
ENGINE_INTERNAL_KEYS = ("_p_side_truncated", "_remote_blocks_processed")

_INTS = {"remote_port", "tp_size", "dcp_size", "pp_size", "remote_block_size", "remote_num_tokens",
         "remote_registration_generation"}
_POSITIVE = {"tp_size", "dcp_size", "pp_size", "remote_block_size"}
_STRINGS = {"remote_engine_id", "remote_request_id", "remote_host"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _block_ids_ok(value: Any) -> bool:
    """A list of block ids, or (hybrid KV caches) one such list per KV cache group."""
    if not isinstance(value, (list, tuple)):
        return False
    return all(_is_int(b) for b in value) or all(
        isinstance(g, (list, tuple)) and all(_is_int(b) for b in g) for g in value)


def _value_problem(key: str, value: Any) -> str | None:
    if key == "remote_block_ids":
        return None if _block_ids_ok(value) else "remote_block_ids: expected a list of block ids"
    if key in _STRINGS:
        return None if isinstance(value, str) and value else f"{key}: expected a non-empty string"
    if key == "remote_blocks_expiry_time":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else f"{key}: expected a number"
    if key in _INTS:
        if not _is_int(value):
            return f"{key}: expected an integer"
        if key == "remote_port" and not 0 < value < 65536:
            return f"remote_port: {value} is not a TCP port"
        if key in _POSITIVE and value < 1:
            return f"{key}: expected at least 1"
        if value < 0:
            return f"{key}: expected a non-negative integer"
    return None


def check_prefill_params(params: Any) -> list[str]:
    """Why a prefill engine's ``kv_transfer_params`` cannot go to a decode engine; empty when it can.

    Each problem names its key. Keys this release does not know are allowed (forwarded as
    they are): a newer engine may add optional ones, and the pair runs one vLLM release.
    """
    if not isinstance(params, Mapping):
        return [f"kv_transfer_params: expected an object, got {type(params).__name__}"]
    problems = []
    if params.get("do_remote_prefill") is not True:
        problems.append("do_remote_prefill: expected true (the decode engine would prefill the prompt again)")
    for key in REQUIRED_KEYS:
        if key not in params:
            problems.append(f"{key}: missing")
        elif (problem := _value_problem(key, params[key])) is not None:
            problems.append(problem)
    for key, nullable in OPTIONAL_KEYS.items():
        if key not in params or (params[key] is None and nullable):
            continue
        if (problem := _value_problem(key, params[key])) is not None:
            problems.append(problem)
    for key in ENGINE_INTERNAL_KEYS:
        if key in params:
            problems.append(f"{key}: set by the engine on its own request, never forwarded")
    return problems
