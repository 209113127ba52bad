"""The admin API's OpenAPI document: every route the server registers, valid OpenAPI 3.1, refs into the schemas."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from aiohttp.test_utils import TestClient, TestServer
from openapi_spec_validator import validate
from openapi_spec_validator.validation.exceptions import OpenAPIValidationError

from llmgw.config import load_schema
from llmgw.controlplane import openapi
from llmgw.controlplane.api import build_api, registered_routes
from llmgw.controlplane.state import ControlPlane
from llmgw.router.endpoints import EndpointTable
from llmgw.router.watch import endpoints_watch_handler
from llmgw.settings import parse_server_settings

TOKEN = "a-long-enough-admin-token-for-tests"


def control_plane() -> ControlPlane:
    return ControlPlane(parse_server_settings({
        "api": {"listen": {"port": 8443},
                "admin_tokens": [{"name": "ops", "sha256": hashlib.sha256(TOKEN.encode()).hexdigest()}]},
        "insecure_no_tls": True,
        "models": [{"name": "tiny", "source": "org/tiny"}],
        "profiles": [{"name": "sim", "engine": "vllm"}],
        "deployments": [{"model": "tiny", "profile": "sim", "replicas": 1}],
    }))


def server_app():
    """The app as ``llmgw server`` builds it: with a reload and the router watch mounted."""
    return build_api(control_plane(), require_identity=False, reload=lambda: (True, []),
                     watch_handler=endpoints_watch_handler(EndpointTable()))


def documented(doc) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}


def test_the_document_lists_exactly_the_routes_the_server_registers():
    app = server_app()
    registered = registered_routes(app)
    assert ("GET", "/v1/nodes") in registered and ("POST", "/v1/nodes/{node_id}/drain") in registered
    table = {(r.method, r.path) for r in openapi.ROUTES}
    missing, stale = registered - table, table - registered
    assert not missing, f"routes registered without an entry in llmgw.controlplane.openapi.ROUTES: {sorted(missing)}"
    assert not stale, f"ROUTES entries the server does not register: {sorted(stale)}"
    assert documented(openapi.document(registered)) == registered


def test_an_app_without_the_watch_documents_no_watch():
    app = build_api(control_plane(), require_identity=False)
    doc = openapi.document(registered_routes(app))
    assert "/v1/router/endpoints" not in doc["paths"] and "/v1/nodes" in doc["paths"]


def test_the_document_is_valid_openapi_3_1():
    doc = openapi.document()
    assert doc["openapi"].startswith("3.1")
    validate(doc)


def test_the_validator_would_catch_a_broken_document():
    doc = openapi.document()
    doc["paths"]["/v1/nodes"]["get"]["responses"]["200"] = {"content": {}}  # a response needs a description
    with pytest.raises(OpenAPIValidationError):
        validate(doc)


def test_schemas_are_referenced_from_the_bundled_files_not_copied():
    doc = openapi.document()
    schemas = doc["components"]["schemas"]
    # the files themselves, their internal refs pointing inside the document
    assert schemas["hardware"]["properties"].keys() == load_schema("hardware")["properties"].keys()
    assert schemas["stream"]["$defs"]["process"] == load_schema("stream")["$defs"]["process"]
    assert schemas["stream"]["$defs"]["hardware"]["properties"]["hardware"] == {"$ref": "#/components/schemas/hardware"}
    assert schemas["Node"]["properties"]["hardware"] == {"$ref": "#/components/schemas/hardware"}
    assert schemas["Shard"]["properties"]["process"]["anyOf"][0] == {"$ref": "#/components/schemas/stream/$defs/process"}
    # every ref resolves inside the document (a file's own "#/$defs/x" or "other.schema.json" would not)
    for target in openapi._refs(doc):
        node = doc
        for part in target.removeprefix("#/").split("/"):
            node = node[part]


def test_security_mutual_tls_and_the_admin_token_and_an_open_healthz():
    doc = openapi.document()
    assert doc["components"]["securitySchemes"]["mutualTLS"]["type"] == "mutualTLS"
    assert doc["components"]["securitySchemes"]["adminToken"] == {**doc["components"]["securitySchemes"]["adminToken"],
                                                                  "type": "http", "scheme": "bearer"}
    assert doc["paths"]["/healthz"]["get"]["security"] == []
    assert doc["paths"]["/openapi.json"]["get"]["security"] == [{"mutualTLS": []}, {"adminToken": []}]
    drain = doc["paths"]["/v1/nodes/{node_id}/drain"]["post"]
    assert drain["parameters"][0]["name"] == "node_id" and drain["parameters"][0]["in"] == "path"
    assert {"202", "401", "403", "404"} <= drain["responses"].keys()


def test_served_at_openapi_json_behind_the_admin_check():
    async def main():
        async with TestClient(TestServer(server_app())) as client:
            refused = await client.get("/openapi.json")
            ok = await client.get("/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"})
            return refused.status, await refused.json(), ok.status, ok.content_type, await ok.json()
    refused_status, refused, status, ctype, doc = asyncio.run(main())
    assert refused_status == 401 and "token" in refused["error"]
    assert status == 200 and ctype == "application/json"
    assert documented(doc) == registered_routes(server_app())
    validate(doc)


def test_unknown_routes_and_methods_are_refused_in_the_error_shape_and_only_after_the_admin_check():
    async def main():
        async with TestClient(TestServer(server_app())) as client:
            out = []
            for method, path, headers in [("PUT", "/v1/nodes", {"Authorization": f"Bearer {TOKEN}"}),
                                          ("GET", "/v1/no-such-route", {"Authorization": f"Bearer {TOKEN}"}),
                                          ("GET", "/v1/no-such-route", {})]:
                r = await client.request(method, path, headers=headers)
                out.append((r.status, r.content_type, await r.json(), r.headers.get("Allow")))
            return out
    wrong_method, no_route, anonymous = asyncio.run(main())
    assert wrong_method[:2] == (405, "application/json") and "allowed: GET, HEAD" in wrong_method[2]["error"]
    assert wrong_method[3] == "GET, HEAD"
    assert no_route[:2] == (404, "application/json") and "/v1/no-such-route" in no_route[2]["error"]
    assert anonymous[0] == 401, "which routes exist is not told before the caller is known"


def test_a_route_with_a_json_body_refers_to_the_schema_its_handler_validates_with():
    report = openapi.Route("POST", "/v1/router/example", "an example with a body", 202, "Health",
                           {**openapi.NOT_YOURS, 400: "the body failed its schema"},
                           body=openapi.ref("router", "endpoint"))
    doc = openapi.document(routes=(*openapi.ROUTES, report))
    body = doc["paths"]["/v1/router/example"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/router/$defs/endpoint"}
    assert doc["components"]["schemas"]["router"]["$defs"]["endpoint"] == load_schema("router")["$defs"]["endpoint"]
    validate(doc)
