"""Schemathesis against a live control plane: no 5xx, every answer as /openapi.json says.

A real ``llmgw server`` with the fleet's PKI, one agent and one Ready
replica (so the answers carry nodes, hardware, shards and processes), the
admin certificate on every request.  The document is the one the server
serves.  Generated path parameters never name the fleet's real node or
replica (their ids carry a random suffix), so the fuzzing cannot cordon or
drain what the run itself needs; the real ids are exercised afterwards, in
an order that leaves the replica's drain for last.
"""

from __future__ import annotations

import json
import os
import socket
import ssl

import pytest
from hypothesis import HealthCheck, given, settings
from openapi_spec_validator import validate

from fleet import Fleet, until

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis 4 needs Python 3.11 or newer (the test extra "
                                                          "installs it there)")
import requests  # noqa: E402  (schemathesis' HTTP client)
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import ignored_auth  # noqa: E402

pytestmark = pytest.mark.integration

# per operation and generation mode, derandomized: the same inputs on every run; more for a longer run
EXAMPLES = int(os.environ.get("LLMGW_ADMIN_FUZZ_EXAMPLES", "25"))
WATCH = "/v1/router/endpoints"
# Authentication is the client certificate, which every request carries: "ignored_auth"
# (the same request without its Authorization header must be refused) does not apply.
EXCLUDED = [ignored_auth]


def fuzz(schema, session: requests.Session, url: str, tls: dict, mode: GenerationMode) -> dict[str, int]:
    """Run every operation's generated cases; returns how many were sent per operation (raises on a failure)."""
    sent: dict[str, int] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        label = f"{op.method.upper()} {op.path}"
        if mode is GenerationMode.NEGATIVE and not schema.raw_schema["paths"][op.path][op.method].get("parameters"):
            continue  # nothing to make invalid

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def one(case) -> None:
            if case.path == WATCH:
                # a poll at the current revision and epoch is a 30 s long poll by design; another epoch
                # makes every poll answer at once, with `after` still generated
                case.query = {**(case.query or {}), "epoch": "not-this-control-plane"}
            case.call_and_validate(session=session, base_url=url, excluded_checks=EXCLUDED, timeout=20, **tls)
            sent[label] = sent.get(label, 0) + 1

        one()
    return sent


def test_admin_api_answers_as_its_openapi_document_says(tmp_path):
    with Fleet(tmp_path, nodes={"node-a": 1}, replicas=1) as f:
        f.start()
        (replica,) = f.wait_ready(1)
        until(lambda: f.get("/v1/nodes")["fleet"]["startup_grace_left_s"] == 0, "the startup grace to end")
        node_id = f.node_ids["node-a"]

        doc = f.get("/openapi.json")
        validate(doc)
        assert json.loads(f.ctl("openapi", "-o", "json").stdout) == doc
        assert "POST    /v1/nodes/{node_id}/drain" in f.ctl("openapi").stdout
        schema = schemathesis.openapi.from_dict(doc)
        session = requests.Session()
        tls = {"cert": tuple(str(p) for p in f.pki.admin), "verify": str(f.pki.ca_cert)}

        sent = fuzz(schema, session, f.url, tls, GenerationMode.POSITIVE)
        assert set(sent) == {f"{m.upper()} {p}" for p, ops in doc["paths"].items() for m in ops}, sent
        negative = fuzz(schema, session, f.url, tls, GenerationMode.NEGATIVE)
        assert "GET /v1/router/endpoints" in negative and "POST /v1/nodes/{node_id}/cordon" in negative, negative

        # The real ids, each answer validated against the document as well.
        def call(method: str, path: str, status: int, **params) -> dict:
            case = schema[path][method].Case(path_parameters=params)
            resp = case.call_and_validate(session=session, base_url=f.url, excluded_checks=EXCLUDED, timeout=20, **tls)
            assert resp.status_code == status, (method, path, resp.status_code, resp.text)
            return resp.json()

        assert call("GET", "/v1/explain/{model}", 200, model="tiny")["replicas"][0]["placed"]
        assert call("POST", "/v1/nodes/{node_id}/cordon", 200, node_id=node_id)["node"]["cordon"] == "cordoned"
        assert call("POST", "/v1/nodes/{node_id}/drain", 202, node_id=node_id)["node"]["cordon"] == "draining"
        nodes = call("GET", "/v1/nodes", 200)
        assert nodes["nodes"][0]["hardware"]["gpus"] and "drained" in nodes["nodes"][0]
        assert call("GET", "/v1/nodes/{node_id}", 200, node_id=node_id)["cordon"] == "draining"
        assert call("GET", "/v1/replicas/{replica_id}", 200,
                    replica_id=replica["replica_id"])["shards"][0]["process"]["pid"] > 0
        assert call("POST", "/v1/nodes/{node_id}/uncordon", 200, node_id=node_id)["was"] == "draining"
        assert call("POST", "/v1/reload", 200)["ok"] is True
        shards = call("GET", "/v1/replicas", 200)["replicas"][0]["shards"]
        assert shards[0]["process"]["pid"] > 0, "the answers checked include an engine process"
        assert call("POST", "/v1/replicas/{replica_id}/drain", 202,
                    replica_id=replica["replica_id"])["replica"]["state"] == "draining"

        # A request the server cannot parse, from a TLS client with no certificate at all: 400, and
        # one warning line in the log for all three, not an ERROR traceback each.
        for _ in range(3):
            status_line = malformed_request(f).split(b"\r\n", 1)[0]
            assert status_line.split()[1:2] == [b"400"], status_line
        log = f.server.output(10_000_000)
        assert log.count("malformed HTTP request from 127.0.0.1 answered 400") == 1, log[-3000:]
        assert f.server.alive()
        assert "Traceback" not in log, log


def malformed_request(f: Fleet) -> bytes:
    ctx = ssl.create_default_context(cafile=str(f.pki.ca_cert))
    with socket.create_connection(("127.0.0.1", f.port), timeout=20) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Probe: \x00\r\n\r\n")
        return tls.recv(4096)
