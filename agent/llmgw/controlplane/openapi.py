"""The admin API's OpenAPI 3.1 document, served at ``/openapi.json``.

It is generated, never written by hand: ``ROUTES`` is the one table of what
the API answers (method, path, success status and shape, errors, who may
call it), and the JSON schemas the control plane validates with
(``schemas/*.schema.json``) are bundled into ``components.schemas`` and
referenced, not copied, so a node's hardware or an engine profile is
described by the very schema its agent's messages are checked against.

A route registered in ``build_api`` without an entry here fails
``tests/unit/test_openapi.py``: declare a new route in ``ROUTES`` (its
answer's shape in ``SHAPES`` if it is new, and a JSON request body as
``body=ref("<schema file>", "<definition>")``, the schema its handler
validates with).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

from llmgw import __version__
from llmgw.config import load_schema
from llmgw.controlplane.listquery import MAX_LIMIT, NODE_STATES, REPLICA_STATES
from llmgw.controlplane.replicas import GONE, WAITING
from llmgw.protocol import Cordon

OPENAPI_PATH = "/openapi.json"
JSON = "application/json"
METRICS_TYPE = "text/plain"

# Who may call a route; each is a list of OpenAPI security requirements (any one suffices).
ADMIN = [{"mutualTLS": []}, {"adminToken": []}]
OPEN: list[dict[str, list[str]]] = []
NODE = [{"mutualTLS": []}]
ROUTER = [{"mutualTLS": []}]  # a router certificate


def ref(schema: str, definition: str | None = None) -> dict[str, str]:
    """A ``$ref`` into a bundled schema file (``schemas/<schema>.schema.json``), or one of its ``$defs``."""
    return {"$ref": f"#/components/schemas/{schema}" + (f"/$defs/{definition}" if definition else "")}


def shape(name: str) -> dict[str, str]:
    """A ``$ref`` to one of the answer shapes in ``SHAPES``."""
    return {"$ref": f"#/components/schemas/{name}"}


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def obj(required: dict[str, Any], optional: dict[str, Any] | None = None) -> dict[str, Any]:
    """An object with these keys (``required`` always present); further keys may be added by newer servers."""
    return {"type": "object", "required": sorted(required), "properties": {**required, **(optional or {})}}


STR = {"type": "string"}
INT = {"type": "integer"}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}
SECONDS = {"type": "number", "minimum": 0}
OPT_STR = {"type": ["string", "null"]}
OPT_SECONDS = {"type": ["number", "null"], "minimum": 0}
COUNTS = {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}}
TIMINGS = {"heartbeat_interval_s": SECONDS, "unreachable_after_s": SECONDS, "lost_after_s": SECONDS}
UNRECORDED = "the store (state_dir or etcd) could not record it; nothing changed"
CORDON = {"enum": [None, *(c.value for c in Cordon)]}
NEXT = {"type": ["string", "null"], "description": "the `after` of the next page; null on the last (or unpaged)"}

# The answers' shapes.  Where the answer carries something a schema file already
# defines (hardware, an engine process, a model's wire form), it is a $ref into it.
SHAPES: dict[str, dict[str, Any]] = {
    "Error": {
        "description": "Every refusal of the admin API: one sentence saying what was wrong and what to do.",
        **obj({"error": STR}),
    },
    "OpenAIError": {
        "description": "The router watch's own input errors, in the OpenAI error shape the router speaks.",
        **obj({"error": obj({"message": STR, "type": STR, "param": OPT_STR, "code": OPT_STR})}),
    },
    "ReloadErrors": {
        "description": "A server.yaml that failed validation: every error, each naming its key's path.",
        **obj({"ok": {"const": False}, "errors": {"type": "array", "items": STR}}),
    },
    "Health": obj({"status": {"const": "ok"}}),
    "CordonView": obj({"node_id": ref("stream", "id"), "cordon": CORDON},
                      {"replicas_left": {"type": "integer", "minimum": 0}, "drained": BOOL,
                       "drain_blocked": OPT_STR}),
    "Node": obj({
        "node_id": ref("stream", "id"), "state": {"enum": list(NODE_STATES)},
        "state_for_s": OPT_SECONDS, "reason": OPT_STR, "connected": BOOL, "epoch": {"type": ["integer", "null"]},
        "last_seen_s": OPT_SECONDS, "address": OPT_STR, "agent_version": OPT_STR, "boot_id": OPT_STR,
        "certificate": nullable(obj({"serial": STR, "not_after": STR, "fingerprint_sha256": STR})),
        "registrations": {"type": "integer", "minimum": 0}, "cordon": CORDON,
        "gpus_total": {"type": "integer", "minimum": 0}, "gpus_free": {"type": "integer", "minimum": 0},
        "gpus": {"type": "array", "items": obj({
            "index": {"type": "integer", "minimum": 0}, "name": STR, "memory_bytes": {"type": "integer", "minimum": 0},
            "uuid": STR, "nvlink_peers": {"type": "array", "items": INT}, "shard": OPT_STR})},
        "nvlink_known": BOOL,
        "fabrics": {"type": "array", "items": ref("hardware", "fabric")},
        "hardware": ref("hardware"),
    }, {"replicas_left": {"type": "integer", "minimum": 0}, "drained": BOOL, "drain_blocked": OPT_STR}),
    "Nodes": obj({"nodes": {"type": "array", "items": shape("Node")}, "fleet": obj({
        "startup_grace_left_s": SECONDS, "unreachable_share": NUM, "damped": BOOL, "hold_reason": OPT_STR,
        **TIMINGS})}, {"next": NEXT}),
    "Summary": obj({
        "nodes": obj({"total": INT, "connected": INT, "by_state": COUNTS}),
        "replicas": obj({"total": INT, "by_state": COUNTS, "desired": INT, "unplaced": INT}),
        "gpus": obj({"total": INT, "claimed": INT, "claimed_twice": INT}),
        "stopping_unrecognised": INT,
        "fleet": obj({"unreachable_share": NUM, "damped": BOOL, "in_grace": BOOL, "hold_reason": OPT_STR,
                      **TIMINGS}),
    }),
    "Shard": obj({
        "shard_id": ref("stream", "id"), "rank": {"type": "integer", "minimum": 0}, "node_id": OPT_STR,
        "gpus": {"type": "array", "items": INT},
        # the agent's states, and the control plane's own "waiting" (not dispatched) and "gone"
        "state": {"anyOf": [ref("stream", "state"), {"enum": [WAITING, GONE]}]},
        "state_for_s": OPT_SECONDS, "reason": OPT_STR, "output_tail": OPT_STR, "pid": {"type": ["integer", "null"]},
        "process": nullable(ref("stream", "process")), "port": {"type": ["integer", "null"]},
        "master_port": {"type": ["integer", "null"]}, "side_port": {"type": ["integer", "null"]}, "address": OPT_STR,
        "scheme": {"enum": ["http", "https", None]}, "engine_version": OPT_STR, "adopted": BOOL,
        "progress": {"type": ["object", "null"]},
    }),
    "Replica": obj({
        "replica_id": STR, "model": STR, "profile": STR, "slot": {"type": ["integer", "null"]},
        "state": {"enum": list(REPLICA_STATES)},
        "reason": OPT_STR, "adopted": BOOL, "age_s": OPT_SECONDS, "ready_for_s": OPT_SECONDS,
        "restarts": {"type": "integer", "minimum": 0}, "replaces": OPT_STR, "placement": {},
        "endpoint": OPT_STR, "engine_version": OPT_STR, "clear_text": {"type": ["boolean", "null"]},
        "route_keys": {"type": ["object", "null"], "description": "route keys its agent relays from the engine's "
                       "KV events: keys held, resets, keys dropped past the cap, seconds since the last report"},
        "retry_in_s": OPT_SECONDS,
        "last_failure": {"type": ["object", "null"]},
        "shards": {"type": "array", "items": shape("Shard")},
    }),
    "Replicas": obj({
        "replicas": {"type": "array", "items": shape("Replica")},
        "unplaced": {"type": "array", "items": obj({"model": STR, "profile": STR, "slot": INT, "reason": OPT_STR,
                                                   "last_failure": {"type": ["object", "null"]}})},
        "stopping_unrecognised": {"type": "array", "items": shape("Shard")},
    }, {"next": NEXT}),
    "ReplicaDrain": obj({"replica": shape("Replica")}),
    "NodeAction": obj({"node": shape("CordonView"), "was": CORDON}),
    "Catalog": obj({
        "source": OPT_STR, "loaded_ago_s": SECONDS,
        # a model's wire form (stream.schema.json#/$defs/model) plus where its size came from
        "models": {"type": "array", "items": obj({"name": STR, "source": STR, "served_name": STR,
                                                  "weights": {"type": "object"}})},
        "profiles": {"type": "array", "items": ref("stream", "profile")},
        "deployments": {"type": "array", "items": obj({"model": STR, "profile": STR,
                                                       "replicas": {"type": "integer", "minimum": 0}}, {
            # only on an autoscaled deployment: its bounds (defaults filled in) and where its count stands
            "autoscale": ref("server", "autoscale"),
            "scaling": obj({"current": INT, "desired": INT, "reason": STR,
                            "wanted": {"type": ["integer", "null"]}, "lead_s": {"type": ["number", "null"]}, "budget": {"type": ["object", "null"]}})})},
    }),
    "Reloaded": obj({"ok": {"const": True}, "errors": {"type": "array", "maxItems": 0},
                     "catalog": shape("Catalog")}),
    "Explain": obj({"model": STR, "replicas": {"type": "array", "items": obj({
        "replica": STR, "placed": BOOL, "running": OPT_STR, "state": OPT_STR, "text": STR, "placement": {},
        "reason": OPT_STR, "nodes": {"type": "array"}}, {
        "route_keys": {"type": ["object", "null"], "description": "a running replica's route keys, as in "
                       "GET /v1/replicas (null: its engine publishes none)"}})}}),
    "Endpoints": obj({"revision": INT, "epoch": STR, "endpoints": {"type": "array", "items": obj(
        {"id": STR, "model": STR, "url": STR, "replica_id": OPT_STR, "draining": BOOL,
         "max_concurrency": {"type": ["integer", "null"]}},
        {"api_key": {"type": "string", "description": "only to a router certificate"},
         "role": {"enum": ["prefill", "decode"], "description": "one side of a prefill/decode pair"},
         "bootstrap_port": {"type": "integer", "description": "an SGLang prefill endpoint's bootstrap server, "
                            "on the endpoint's host: routers name it in each request (dual dispatch)"},
         "requires_prefill": {"type": "boolean", "description": "a decode endpoint that cannot compute a "
                              "prompt itself (SGLang): its model needs a prefill endpoint"},
         "sleeping": BOOL})}},
        {"route_keys": {**obj({"epoch": STR, "revision": INT, "full": BOOL, "replicas": {"type": "array", "items": obj(
            {"replica_id": STR}, {"reset": BOOL, "added": {"type": "array", "items": ref("stream", "route_key")},
                                  "removed": {"type": "array", "items": ref("stream", "route_key")}})}}),
            "description": "only when asked (`kv_after`): changes to each replica's route keys since that "
                           "revision, or every replica's keys (`full`)"}}),
    "OpenAPI": {"type": "object", "required": ["openapi", "info", "paths"]},
    "EjectionsAccepted": obj({"accepted": {"type": "integer", "minimum": 0}}),
    "AllowanceAnswers": obj({"answers": {"type": "array", "items": obj({}, {
        "lease": STR, "amount": INT, "ttl": NUM, "remaining": INT, "reset": NUM, "limit": INT,
        "retry_after": {"type": ["number", "null"], "description": "a denial: seconds to wait; null: never fits"}})}}),
    "WakeAccepted": obj({"waking": BOOL}),
}

PARAMS: dict[str, dict[str, Any]] = {
    "node_id": {"description": "a node id, as `GET /v1/nodes` lists it", "schema": ref("stream", "id")},
    "replica_id": {"description": "a replica id, as `GET /v1/replicas` lists it", "schema": ref("stream", "id")},
    "model": {"description": "a model's catalog name or served name", "schema": {"type": "string", "minLength": 1}},
}


@dataclass(frozen=True)
class Route:
    """One (method, path) the API answers, and what it answers."""

    method: str
    path: str
    summary: str
    ok: int
    answer: str | None  # a SHAPES key; None for a non-JSON answer
    errors: dict[int, str] = field(default_factory=dict)  # status -> why (Error shape unless ``error_shapes``)
    security: list[dict[str, list[str]]] = field(default_factory=lambda: ADMIN)
    content_type: str = JSON
    query: tuple[dict[str, Any], ...] = ()
    error_shapes: dict[int, dict[str, Any]] = field(default_factory=dict)
    headers: dict[int, dict[str, Any]] = field(default_factory=dict)
    # the JSON request body's schema, a ref() into the schema file the handler validates it with
    body: dict[str, Any] | None = None


def list_query(what: str, states: tuple[str, ...]) -> tuple[dict[str, Any], ...]:
    """The query parameters of a list read (``listquery``): states, and a page keyed by id."""
    return ({"name": "state", "in": "query", "required": False, "style": "form", "explode": False,
             "schema": {"type": "array", "minItems": 1, "items": {"enum": list(states)}},
             "description": f"only {what}s in these states (comma-separated, or repeated)"},
            {"name": "limit", "in": "query", "required": False,
             "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT},
             "description": f"at most this many {what}s, in {what} id order; `next` in the answer names the next page"},
            {"name": "after", "in": "query", "required": False, "schema": {"type": "string", "minLength": 1},
             "description": f"start after this {what} id (the previous page's `next`), in {what} id order"})


NOT_YOURS = {401: "no admin certificate and no (or a malformed) bearer token",
             403: "a certificate of another role, or an unknown admin token"}

ROUTES: tuple[Route, ...] = (
    Route("GET", "/healthz", "Liveness: answers as soon as the API listens; open to any TLS client", 200, "Health",
          security=OPEN),
    Route("GET", "/v1/agent/stream", "The agent stream (WebSocket, node certificate only); its messages are "
          "components.schemas.stream", 101, None, {403: "not a node certificate"}, security=NODE),
    Route("GET", "/v1/nodes", "Every node (or a page of them, or those in some states): lifecycle state, "
          "hardware, GPUs and what holds them", 200, "Nodes",
          {**NOT_YOURS, 400: "a query parameter that is unknown, repeated or out of range"},
          query=list_query("node", NODE_STATES)),
    Route("GET", "/v1/nodes/{node_id}", "One node, as an element of GET /v1/nodes", 200, "Node",
          {**NOT_YOURS, 404: "no such node has registered"}),
    Route("GET", "/v1/summary", "The fleet in counts (cheap to poll)", 200, "Summary", NOT_YOURS),
    Route("GET", "/v1/replicas", "Every replica (or a page of them, or those in some states) with its shards, "
          "failures and download progress", 200, "Replicas",
          {**NOT_YOURS, 400: "a query parameter that is unknown, repeated or out of range"},
          query=list_query("replica", REPLICA_STATES)),
    Route("GET", "/v1/replicas/{replica_id}", "One replica, as an element of GET /v1/replicas", 200, "Replica",
          {**NOT_YOURS, 404: "the control plane knows no such replica"}),
    Route("GET", "/v1/catalog", "The catalog in force: models, profiles, deployments", 200, "Catalog", NOT_YOURS),
    Route("GET", "/v1/explain/{model}", "Where each declared replica of a model runs, or why it cannot be placed",
          200, "Explain", {**NOT_YOURS, 404: "the model is not in the catalog"}),
    Route("POST", "/v1/replicas/{replica_id}/drain", "Take a replica out of the router, stop it and replace it",
          202, "ReplicaDrain", {**NOT_YOURS, 404: "no such replica", 409: "the replica cannot be drained now",
                                      503: UNRECORDED}),
    Route("POST", "/v1/nodes/{node_id}/cordon", "Place nothing new on a node (what runs there stays)", 200,
          "NodeAction", {**NOT_YOURS, 404: "no such node has registered", 503: UNRECORDED}),
    Route("POST", "/v1/nodes/{node_id}/drain", "Cordon a node and move its replicas elsewhere, make before break",
          202, "NodeAction", {**NOT_YOURS, 404: "no such node has registered", 503: UNRECORDED}),
    Route("POST", "/v1/nodes/{node_id}/uncordon", "Make a cordoned or draining node schedulable again", 200,
          "NodeAction", {**NOT_YOURS, 404: "no such node has registered", 503: UNRECORDED}),
    Route("POST", "/v1/reload", "Re-read server.yaml; a file that fails validation is refused, the catalog stays",
          200, "Reloaded", {**NOT_YOURS, 400: "server.yaml failed validation (every error listed)",
                            409: "started without a config file"},
          error_shapes={400: shape("ReloadErrors")}),
    Route("GET", "/metrics", "Prometheus metrics", 200, None, NOT_YOURS, content_type=METRICS_TYPE),
    Route("GET", "/v1/router/endpoints", "Long poll of the router endpoint set (answers at once when `after` is "
          "behind, else within 30 s); engine keys only to a router certificate", 200, "Endpoints",
          {**NOT_YOURS, 400: "`after` or `kv_after` is not an integer",
           503: "the control plane is in its startup grace: keep what you have, ask again after Retry-After"},
          query=({"name": "after", "in": "query", "required": False, "schema": {"type": "integer"},
                  "description": "the revision the caller has (-1 or absent: none)"},
                 {"name": "epoch", "in": "query", "required": False, "schema": STR,
                  "description": "the epoch the caller's revision belongs to"},
                 {"name": "kv_after", "in": "query", "required": False, "schema": {"type": "integer"},
                  "description": "the route-key revision the caller has (-1: none); absent: no route keys"},
                 {"name": "kv_epoch", "in": "query", "required": False, "schema": STR,
                  "description": "the epoch the caller's route-key revision belongs to"}),
          error_shapes={400: shape("OpenAIError")},
          headers={503: {"Retry-After": {"schema": {"type": "string", "pattern": "^[0-9]+$"}}}}),
    Route("GET", OPENAPI_PATH, "This document", 200, "OpenAPI", NOT_YOURS),
    Route("POST", "/v1/router/ejections", "A router's report of the engines it ejected after failures, re-sent "
          "while they last (router certificate only; the router is named by its certificate)", 202,
          "EjectionsAccepted",
          {400: "the body is not JSON or not a report; `errors` lists each problem with its JSON pointer",
           403: "not a router certificate", 429: "this router reports too often; again after Retry-After"},
          security=ROUTER, body=ref("router-ejections"),
          headers={429: {"Retry-After": {"schema": {"type": "string", "pattern": "^[0-9]+$"}}}}),
    Route("POST", "/v1/router/allowance", "A router worker returns the slices of per-key limits it leased and "
          "asks for new ones; one answer per ask, a lease or a denial (router certificate only)", 200,
          "AllowanceAnswers",
          {400: "the body is not JSON or not an allowance request; `errors` lists each problem with its JSON pointer",
           403: "not a router certificate", 503: "the books are new (after a start or a failover); again after Retry-After"},
          security=ROUTER, body=ref("router-allowance"),
          headers={503: {"Retry-After": {"schema": {"type": "string", "pattern": "^[0-9]+$"}}}}),
    Route("POST", "/v1/router/wake", "A router holds requests for a model whose endpoints are all asleep: wake "
          "its replicas (scale to sleep; router certificate only). `waking` is false when no deployment with "
          "autoscale.sleep serves the model", 202, "WakeAccepted",
          {400: "the body is not JSON or not a wake request; `errors` lists each problem with its JSON pointer",
           403: "not a router certificate", 413: "the body is too large",
           429: "this router asks too often; again after Retry-After"},
          security=ROUTER, body=ref("router-wake"),
          headers={429: {"Retry-After": {"schema": {"type": "string", "pattern": "^[0-9]+$"}}}}),
    Route("POST", "/v1/router/load", "A standalone router's worker reports its requests in flight per replica, "
          "every second (the autoscaler's signal beside the control plane's own router; router certificate only)",
          202, "EjectionsAccepted",
          {400: "the body is not JSON or not a load report; `errors` lists each problem with its JSON pointer",
           403: "not a router certificate", 413: "the body is too large",
           429: "this router reports too often; again after Retry-After"},
          security=ROUTER, body=ref("router-load"),
          headers={429: {"Retry-After": {"schema": {"type": "string", "pattern": "^[0-9]+$"}}}}),
)

_PARAM = re.compile(r"{([^}]+)}")


def bundle(names: list[str]) -> dict[str, Any]:
    """The schema files ``names`` (and those they reference), with every ``$ref`` pointing inside the document.

    ``#/$defs/x`` in ``server.schema.json`` becomes
    ``#/components/schemas/server/$defs/x`` and ``hardware.schema.json``
    becomes ``#/components/schemas/hardware``; ``$id`` and ``$schema`` are
    dropped (the document's dialect is 2020-12, the schemas' own).
    """
    out: dict[str, Any] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in out:
            continue

        def rewrite(node: Any, name: str = name) -> Any:
            if isinstance(node, dict):
                node = {k: rewrite(v) for k, v in node.items() if k not in ("$id", "$schema")}
                target = node.get("$ref")
                if isinstance(target, str):
                    if target.startswith("#"):
                        node["$ref"] = f"#/components/schemas/{name}{target[1:]}"
                    else:
                        other, _, pointer = target.partition("#")
                        other = other.removesuffix(".schema.json")
                        todo.append(other)
                        node["$ref"] = f"#/components/schemas/{other}{pointer}"
                return node
            if isinstance(node, list):
                return [rewrite(v) for v in node]
            return node

        out[name] = rewrite(load_schema(name))
    return out


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


def _error(why: str, schema: dict[str, Any] | None) -> dict[str, Any]:
    return {"description": why, "content": {JSON: {"schema": schema or shape("Error")}}}


def _operation(route: Route) -> dict[str, Any]:
    ok: dict[str, Any] = {"description": route.summary}
    if route.answer is not None:
        ok["content"] = {route.content_type: {"schema": shape(route.answer)}}
    elif route.content_type != JSON:
        ok["content"] = {route.content_type: {"schema": STR}}
    responses: dict[str, Any] = {str(route.ok): ok}
    for status, why in sorted(route.errors.items()):
        responses[str(status)] = _error(why, route.error_shapes.get(status))
        if status == 401:
            responses["401"]["headers"] = {"WWW-Authenticate": {"schema": STR}}
        if status in route.headers:
            responses[str(status)]["headers"] = route.headers[status]
    params = [{"name": p, "in": "path", "required": True, **PARAMS[p]} for p in _PARAM.findall(route.path)]
    op: dict[str, Any] = {"summary": route.summary, "operationId": _operation_id(route),
                          "security": route.security, "responses": responses}
    if params or route.query:
        op["parameters"] = [*params, *route.query]
    if route.body is not None:
        op["requestBody"] = {"required": True, "content": {JSON: {"schema": route.body}}}
    return op


def _operation_id(route: Route) -> str:
    words = re.sub(r"[{}]", "", route.path).strip("/").replace(".", "_").replace("-", "_").split("/")
    return route.method.lower() + "_" + "_".join(w for w in words if w and w != "v1")


def document(registered: set[tuple[str, str]] | None = None,
             routes: tuple[Route, ...] = ROUTES) -> dict[str, Any]:
    """The OpenAPI 3.1 document; with ``registered`` ((method, path) pairs), only the routes this app has."""
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if registered is not None and (route.method, route.path) not in registered:
            continue
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route)
    wanted = {r.split("/")[3] for r in _refs([paths, SHAPES, PARAMS]) if r.startswith("#/components/schemas/")}
    schemas = {**bundle(sorted(wanted - set(SHAPES))), **copy.deepcopy(SHAPES)}
    return {
        "openapi": "3.1.0",
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "info": {"title": "llmgw control plane admin API", "version": __version__,
                 "description": "Every route but /healthz needs an admin certificate (mutual TLS, role admin) or "
                                "an admin bearer token; the agent stream takes node certificates only, the router "
                                "watch router certificates too."},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": {
            "mutualTLS": {"type": "mutualTLS", "description": "a client certificate issued by the fleet CA; its "
                                                              "role (admin, node, router) decides what it may call"},
            "adminToken": {"type": "http", "scheme": "bearer", "description": "an admin token (server.yaml "
                                                                               "api.admin_tokens holds its sha256)"},
        }},
    }
