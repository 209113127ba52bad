"""``GET /v1/nodes/{id}``, ``GET /v1/replicas/{id}`` and the filtered, paged ``GET /v1/nodes``.

A client asking about one node (node_cordon polling a drain, ``ctl drain``
telling a node from a replica) reads that node, not the whole fleet; the
inventory plugin reads the fleet in pages.  The per-id answers are the very
elements of the lists, so one parser serves both.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from jsonschema import Draft202012Validator

from llmgw.controlplane import openapi, views
from llmgw.controlplane.api import build_api
from llmgw.controlplane.listquery import NODE_STATES, ListQuery, QueryError, parse_list_query
from llmgw.controlplane.messages import parse_up
from llmgw.controlplane.state import ControlPlane
from llmgw.hardware.types import GPU, HardwareInventory
from llmgw.settings import parse_server_settings

TOKEN = "a-long-enough-admin-token-for-tests"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
GIB = 1 << 30


class Session:
    epoch = 0

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, msg: dict[str, Any]) -> bool:
        self.sent.append(msg)
        return True

    def close(self, reason: str) -> None:
        pass


def control_plane(*node_ids: str) -> ControlPlane:
    cp = ControlPlane(parse_server_settings({
        "api": {"listen": {"port": 8443},
                "admin_tokens": [{"name": "ops", "sha256": hashlib.sha256(TOKEN.encode()).hexdigest()}]},
        "insecure_no_tls": True,
        "lifecycle": {"startup_grace": 0},
        "models": [{"name": "tiny", "source": "org/tiny", "size_bytes": 1 << 30}],
        "profiles": [{"name": "sim", "engine": "vllm"}],
        "deployments": [{"model": "tiny", "profile": "sim", "replicas": 1}],
    }), clock=lambda: 1000.0)  # a still clock: ages read the same in the list and the per-id answer
    for node_id in node_ids:
        hw = HardwareInventory(node_id=node_id, gpu_source="simulated",
                               gpus=(GPU(0, "GPU-0", "Sim", 80 * GIB, "00000000:01:00.0"),)).to_dict()
        msg = {"type": "register", "node_id": node_id, "agent_version": "t", "boot_id": "b",
               "address": "127.0.0.1", "hardware": hw, "shards": []}
        cp.register(parse_up(json.dumps(msg)), Session())
    cp.tick()
    return cp


def answers(cp: ControlPlane, paths: list[str], headers: dict[str, str] | None = ADMIN) -> list[tuple[int, Any]]:
    async def main():
        async with TestClient(TestServer(build_api(cp, require_identity=False))) as client:
            out = []
            for path in paths:
                r = await client.get(path, headers=headers or {})
                out.append((r.status, await r.json()))
            return out
    return asyncio.run(main())


def conforms(doc: Any, shape: str) -> None:
    """``doc`` is valid against the answer shape the OpenAPI document declares."""
    full = openapi.document()
    schema = {**full["components"]["schemas"][shape], "components": full["components"]}
    errors = sorted(Draft202012Validator(schema).iter_errors(doc), key=str)
    assert not errors, [f"{list(e.absolute_path)}: {e.message}" for e in errors[:5]]


def test_one_node_and_one_replica_are_the_elements_of_the_lists():
    cp = control_plane("gpu-a", "gpu-b")
    (replica_id,) = cp.reconciler.book.replicas
    (_, all_nodes), (_, a), (_, all_replicas), (_, r) = answers(
        cp, ["/v1/nodes", "/v1/nodes/gpu-a", "/v1/replicas", f"/v1/replicas/{replica_id}"])
    assert a == next(n for n in all_nodes["nodes"] if n["node_id"] == "gpu-a")
    assert r == all_replicas["replicas"][0] and r["replica_id"] == replica_id and r["shards"]
    conforms(a, "Node")
    conforms(r, "Replica")
    conforms(all_nodes, "Nodes")
    assert all_nodes["next"] is None, "a read without limit is the whole list, as before"


def test_unknown_ids_are_404_naming_the_id():
    cp = control_plane("gpu-a")
    (s1, node), (s2, replica) = answers(cp, ["/v1/nodes/gpu-zz", "/v1/replicas/tiny-sim-nope"])
    assert s1 == 404 and "'gpu-zz'" in node["error"] and "gpu-a" in node["error"]
    assert s2 == 404 and "'tiny-sim-nope'" in replica["error"]


def test_per_id_reads_are_admin_only():
    cp = control_plane("gpu-a")
    (replica_id,) = cp.reconciler.book.replicas
    for status, body in answers(cp, ["/v1/nodes/gpu-a", f"/v1/replicas/{replica_id}"], headers=None):
        assert status == 401 and "token" in body["error"]
    wrong = answers(cp, ["/v1/nodes/gpu-a"], headers={"Authorization": "Bearer not-the-token"})
    assert wrong[0][0] == 403


def test_a_404_names_a_few_known_nodes_not_the_whole_fleet():
    assert views.some_of([]) == "none"
    assert views.some_of(["b", "a"]) == "a, b"
    assert views.some_of([f"n{i:05}" for i in range(10_000)], at_most=3) == "n00000, n00001, n00002 and 9,997 more"


def test_pages_cover_every_node_once_and_say_where_the_next_starts():
    cp = control_plane(*(f"gpu-{i}" for i in range(7)))
    seen: list[str] = []
    after = None
    pages = 0
    while True:
        ((status, doc),) = answers(cp, ["/v1/nodes?limit=3" + (f"&after={after}" if after else "")])
        assert status == 200 and len(doc["nodes"]) <= 3
        seen += [n["node_id"] for n in doc["nodes"]]
        pages += 1
        after = doc["next"]
        if after is None:
            break
    assert seen == sorted(cp.nodes) and pages == 3


def test_a_page_key_that_went_away_still_continues_after_it():
    cp = control_plane("a", "c", "e")
    got = views.nodes_view(cp, ListQuery(limit=5, after="b"))
    assert [n["node_id"] for n in got["nodes"]] == ["c", "e"] and got["next"] is None
    exact = views.nodes_view(cp, ListQuery(limit=2))
    assert [n["node_id"] for n in exact["nodes"]] == ["a", "c"] and exact["next"] == "c"


def test_state_filter_picks_nodes_by_lifecycle_state():
    cp = control_plane("a", "b", "c")
    cp.nodes["b"].clock.state = type(cp.nodes["b"].clock.state)("lost")
    ((_, lost), (_, up), (_, both)) = answers(cp, ["/v1/nodes?state=lost", "/v1/nodes?state=ready",
                                                   "/v1/nodes?state=ready&state=lost&limit=2"])
    assert [n["node_id"] for n in lost["nodes"]] == ["b"]
    assert [n["node_id"] for n in up["nodes"]] == ["a", "c"]
    assert [n["node_id"] for n in both["nodes"]] == ["a", "b"] and both["next"] == "b"


@pytest.mark.parametrize("query, needle", [
    ("state=gone", "state must be one or more of ready, unreachable, lost"),
    ("state=", "got ''"),
    ("limit=0", "limit must be a whole number from 1 to 10000, got '0'"),
    ("limit=-1", "got '-1'"),
    ("limit=ten", "got 'ten'"),
    ("limit=10001", "got '10001'"),
    ("limit=5&limit=6", "limit is given 2 times"),
    ("after=", "after must be an id"),
    ("states=lost", "unknown query parameter states; /v1/nodes takes state, limit, after"),
])
def test_bad_queries_are_400_saying_what_is_wrong(query, needle):
    cp = control_plane("a")
    ((status, doc),) = answers(cp, [f"/v1/nodes?{query}"])
    assert status == 400 and needle in doc["error"], doc


def test_replicas_page_in_replica_id_order_and_filter_by_state():
    cp = ControlPlane(parse_server_settings({
        "api": {"listen": {"port": 8443},
                "admin_tokens": [{"name": "ops", "sha256": hashlib.sha256(TOKEN.encode()).hexdigest()}]},
        "insecure_no_tls": True, "lifecycle": {"startup_grace": 0},
        "models": [{"name": "tiny", "source": "org/tiny", "size_bytes": 1 << 30}],
        "profiles": [{"name": "sim", "engine": "vllm"}],
        "deployments": [{"model": "tiny", "profile": "sim", "replicas": 5}],
    }), clock=lambda: 1000.0)
    for node_id in ("a", "b", "c", "d", "e"):
        hw = HardwareInventory(node_id=node_id, gpu_source="simulated",
                               gpus=(GPU(0, "GPU-0", "Sim", 80 * GIB, "00000000:01:00.0"),)).to_dict()
        cp.register(parse_up(json.dumps({"type": "register", "node_id": node_id, "agent_version": "t", "boot_id": "b",
                                         "address": "127.0.0.1", "hardware": hw, "shards": []})), Session())
    cp.tick()
    ids = sorted(cp.reconciler.book.replicas)
    assert len(ids) == 5
    (_, whole), (_, first), (_, ready), (_, starting), (s, bad) = answers(cp, [
        "/v1/replicas", "/v1/replicas?limit=2", "/v1/replicas?state=ready", "/v1/replicas?state=starting,failed&limit=9",
        "/v1/replicas?state=lost"])
    assert [r["replica_id"] for r in starting["replicas"]] == ids and starting["next"] is None
    assert whole["next"] is None and len(whole["replicas"]) == 5
    assert [r["replica_id"] for r in first["replicas"]] == ids[:2] and first["next"] == ids[1]
    assert first["unplaced"] == whole["unplaced"], "the small lists come whole with every page"
    assert ready["replicas"] == [], "none is Ready yet"
    assert s == 400 and "state must be one or more of starting, ready, failed, stopping, draining" in bad["error"]
    seen, after = [], None
    while True:
        doc = views.replicas_view(cp, ListQuery(limit=2, after=after))
        seen += [r["replica_id"] for r in doc["replicas"]]
        after = doc["next"]
        if after is None:
            break
    assert seen == ids
    conforms(first, "Replicas")


def test_the_parser_takes_comma_separated_states():
    assert parse_list_query({"state": ["ready,lost"]}, "/v1/nodes", NODE_STATES).states == {"ready", "lost"}
    assert parse_list_query({}, "/v1/nodes", NODE_STATES) == ListQuery()
    with pytest.raises(QueryError):
        parse_list_query({"limit": ["５"]}, "/v1/nodes", NODE_STATES)  # a digit, but not an ASCII one


def test_admin_requests_are_counted_by_route_template_not_by_path():
    cp = control_plane("gpu-a", "gpu-b")

    async def main():
        async with TestClient(TestServer(build_api(cp, require_identity=False))) as client:
            for path in ("/v1/nodes/gpu-a", "/v1/nodes/gpu-b", "/v1/nodes", "/v1/no-such-route"):
                await client.get(path, headers=ADMIN)
            await client.get("/v1/nodes")  # refused: not counted
            return await (await client.get("/metrics", headers=ADMIN)).text()
    text = asyncio.run(main())
    assert 'llmgw_admin_requests_total{method="GET",route="/v1/nodes/{node_id}"} 2.0' in text
    assert 'llmgw_admin_requests_total{method="GET",route="/v1/nodes"} 1.0' in text
    assert 'llmgw_admin_requests_total{method="GET",route="(no route)"} 1.0' in text
    assert "gpu-a" not in "".join(line for line in text.splitlines() if "admin_requests" in line)
