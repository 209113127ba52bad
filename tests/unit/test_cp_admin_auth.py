"""Without TLS the admin API is never open: a token is required, and with none configured it is closed."""

from __future__ import annotations

import asyncio
import hashlib
import logging

from aiohttp.test_utils import TestClient, TestServer

from llmgw.controlplane.api import build_api
from llmgw.controlplane.state import ControlPlane
from llmgw.settings import parse_server_settings

TOKEN = "a-long-enough-admin-token-for-tests"
ADMIN_PATHS = ["/v1/nodes", "/v1/replicas", "/v1/catalog", "/v1/explain/tiny", "/metrics"]


def settings(tokens: bool):
    api = {"listen": {"port": 8443}}
    if tokens:
        api["admin_tokens"] = [{"name": "ops", "sha256": hashlib.sha256(TOKEN.encode()).hexdigest()}]
    return parse_server_settings({
        "api": api, "insecure_no_tls": True,
        "models": [{"name": "tiny", "source": "org/tiny"}],
        "profiles": [{"name": "sim", "engine": "vllm"}],
        "deployments": [{"model": "tiny", "profile": "sim", "replicas": 1}],
    })


def answers(cp: ControlPlane, requests: list[tuple[str, str, dict[str, str]]]) -> list[tuple[int, object, str | None]]:
    """(status, body) for each (method, path, headers), against a real server on loopback."""
    async def main():
        app = build_api(cp, require_identity=False, reload=lambda: (True, []))
        async with TestClient(TestServer(app)) as client:
            out = []
            for method, path, headers in requests:
                r = await client.request(method, path, headers=headers)
                body = await r.json() if r.content_type == "application/json" else await r.text()
                out.append((r.status, body, r.headers.get("WWW-Authenticate")))
            return out
    return asyncio.run(main())


def test_insecure_without_tokens_refuses_every_admin_request_and_says_what_to_configure(caplog):
    caplog.set_level(logging.WARNING, logger="llmgw.controlplane")
    cp = ControlPlane(settings(tokens=False))
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    reqs = [("GET", p, {}) for p in ADMIN_PATHS] + [("GET", "/v1/nodes", bearer),
                                                    ("POST", "/v1/reload", {}), ("POST", "/v1/replicas/x/drain", {})]
    got = answers(cp, reqs + [("GET", "/healthz", {})])
    *refused, health = got
    for (method, path, _), (status, body, challenge) in zip(reqs, refused):
        assert status == 401, (method, path, status, body)
        assert "api.admin_tokens" in body["error"] and "closed" in body["error"], body
        assert challenge == 'Bearer realm="llmgw"'
    assert health[:2] == (200, {"status": "ok"})
    startup = [r for r in caplog.records if r.levelno == logging.ERROR and "admin API is CLOSED" in r.getMessage()]
    assert len(startup) == 1
    assert any("refused GET /v1/nodes" in r.getMessage() for r in caplog.records)


def test_insecure_with_tokens_needs_the_right_token():
    cp = ControlPlane(settings(tokens=True))
    got = answers(cp, [
        ("GET", "/v1/nodes", {}),
        ("GET", "/v1/nodes", {"Authorization": "Bearer wrong-token"}),
        ("GET", "/v1/nodes", {"Authorization": "Basic abc"}),
        ("GET", "/v1/nodes", {"Authorization": f"Bearer {TOKEN}"}),
        ("GET", "/metrics", {"Authorization": f"Bearer {TOKEN}"}),
        ("GET", "/metrics", {}),
        ("GET", "/healthz", {}),
    ])
    assert got[0][0] == 401 and "admin bearer token is required" in got[0][1]["error"]
    assert got[1][:2] == (403, {"error": "unknown admin token"})
    assert got[2][0] == 401
    assert got[3][0] == 200 and got[3][1]["nodes"] == []
    assert got[4][0] == 200 and "llmgw_" in got[4][1]
    assert got[5][0] == 401
    assert got[6][0] == 200


def test_a_reload_that_adds_tokens_opens_the_api_without_a_restart():
    cp = ControlPlane(settings(tokens=False))
    bearer = {"Authorization": f"Bearer {TOKEN}"}

    async def main():
        app = build_api(cp, require_identity=False)
        async with TestClient(TestServer(app)) as client:
            before = (await client.get("/v1/catalog", headers=bearer)).status
            cp.apply_settings(settings(tokens=True), None)
            after = (await client.get("/v1/catalog", headers=bearer)).status
            return before, after

    assert asyncio.run(main()) == (401, 200)
