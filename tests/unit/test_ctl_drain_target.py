"""``ctl drain`` tells a node from a replica by reading each id, against a server on loopback.

An older control plane, without the per-id routes, answers 404 "no route":
that is said as such, not taken for "no such node or replica".
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from llmgw.ctl.fleet import CtlError, target_kind


@contextmanager
def serving(answers: dict[str, tuple[int, dict[str, Any]]]) -> Iterator[tuple[str, list[str]]]:
    """Answers GET path -> (status, JSON body); anything else 404 "no route", as the API says it."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            asked.append(self.path)
            status, body = answers.get(self.path, (404, {"error": f"no route {self.path} (the routes: ...)"}))
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()


def args(url: str) -> argparse.Namespace:
    return argparse.Namespace(url=url, ca=None, cert=None, key=None, token="t", revoked=None, timeout=5, output="text")


NO_NODE = (404, {"error": "no node 'x' has registered; known: gpu-1"})
NO_REPLICA = (404, {"error": "no replica 'x' (GET /v1/replicas lists them)"})


def test_a_node_is_read_by_its_id_and_nothing_else():
    with serving({"/v1/nodes/gpu-1": (200, {"node_id": "gpu-1"})}) as (url, asked):
        assert target_kind(args(url), "gpu-1") == "node"
    assert asked == ["/v1/nodes/gpu-1"]


def test_a_replica_is_not_a_node_and_then_read_by_its_id():
    with serving({"/v1/nodes/tiny.sim.0-aa": NO_NODE, "/v1/replicas/tiny.sim.0-aa": (200, {"replica_id": "r"})}) as (
            url, asked):
        assert target_kind(args(url), "tiny.sim.0-aa") == "replica"
    assert asked == ["/v1/nodes/tiny.sim.0-aa", "/v1/replicas/tiny.sim.0-aa"]


def test_neither_is_said_so():
    with serving({"/v1/nodes/x": NO_NODE, "/v1/replicas/x": NO_REPLICA}) as (url, _):
        with pytest.raises(CtlError, match="'x' is neither a registered node"):
            target_kind(args(url), "x")


def test_an_older_control_plane_without_the_routes_is_named_not_taken_for_an_unknown_id():
    with serving({}) as (url, asked):
        with pytest.raises(CtlError, match="has no such route: it is older than this llmgw ctl"):
            target_kind(args(url), "gpu-1")
    assert asked == ["/v1/nodes/gpu-1"]
