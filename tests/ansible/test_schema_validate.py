"""llmgw.fleet.schema_validate through ansible-playbook, against the runtime's own schemas.

Four runs (check, apply, check, apply) of every case: never a change, and the
same verdict each time. For every configuration fixture the module reports
exactly the errors the runtime's own validator reports, so a fleet that
passes preflight passes the runtime's schema check, and the other way round.
"""

from __future__ import annotations

import pytest
import yaml

from fleet_harness import FIXTURES, PLAYBOOKS, REPO, four_runs
from llmgw.config import schema_errors

SCHEMAS = REPO / "agent" / "llmgw" / "schemas"
CONFIGS = sorted((FIXTURES / "config").glob("*.yaml"))
LOCAL_FILES = REPO / "inventory" / "local" / "files"


def _kind(path):
    return path.name.split("-")[0].split(".")[0]


def _fixture_cases():
    out = []
    for path in CONFIGS + [LOCAL_FILES / "server.yaml", LOCAL_FILES / "agent.yaml", *sorted((LOCAL_FILES / "hardware").glob("*.yaml"))]:
        kind = "hardware" if path.parent.name == "hardware" else _kind(path)
        out.append({"name": f"{path.parent.name}/{path.name}", "schema": kind, "document": yaml.safe_load(path.read_text())})
    return out


BAD_SERVER = {
    "api": {"listen": {"port": "8443"}},
    "models": [{"name": "m", "source": "/m"}],
    "profiles": [{"name": "p", "engine": "vlm", "tensor_parallel_size": 0}],
    "deployments": [{"model": "m", "profile": "p", "replicas": 1, "replica": 2}],
    "router": {"listen": {"port": 70000}},
}
ORIGINS = {"/api/listen/port": "llmgw_api_port", "/profiles": "llmgw_profiles", "/deployments": "llmgw_deployments", "/router": "llmgw_router"}

# keys failing propertyNames: both sides point at the key, not the object holding it
BAD_ENV_NAMES = {"name": "bad-env-names", "schema": "server", "document": {
    "api": {"listen": {"port": 8443}}, "models": [{"name": "m", "source": "/m"}],
    "profiles": [{"name": "p", "engine": "vllm", "env": {"9LIVES": "x", "a/b~c": "y", "OK": "z"}}],
    "deployments": [{"model": "m", "profile": "p", "replicas": 1}]}}

CASES = _fixture_cases() + [BAD_ENV_NAMES] + [
    {"name": "bad-server", "schema": "server", "document": BAD_SERVER, "origins": ORIGINS},
    {"name": "not-a-mapping", "schema": "agent", "document": ["node_id"]},
    {"name": "unknown-schema", "schema": "servr", "document": {}},
    {"name": "no-schema-dir", "schema": "server", "document": {}, "schema_dir": "/nonexistent/schemas"},
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return four_runs(
        PLAYBOOKS / "schema_validate.yml", tmp_path_factory.mktemp("schema"),
        extravars={"cases": CASES, "schema_dir": str(SCHEMAS)},
    )


def results(run):
    out = {r.item["name"]: r for r in run.task("Validate documents")}
    assert set(out) == {c["name"] for c in CASES}, run.explain()
    return out


@pytest.mark.parametrize("index", range(4), ids=["check", "apply", "check-again", "apply-again"])
def test_never_changes_anything(runs, index):
    assert runs[index].changed() == 0, runs[index].explain()


@pytest.mark.parametrize("case", _fixture_cases() + [BAD_ENV_NAMES], ids=lambda c: c["name"])
def test_same_errors_as_the_runtime(runs, case):
    expected = [{"pointer": e.pointer, "message": e.message} for e in schema_errors(case["document"], case["schema"])]
    for run in runs:
        res = results(run)[case["name"]]
        got = [{"pointer": e["pointer"], "message": e["message"]} for e in res.res["errors"]]
        assert got == expected
        assert (res.status == "ok") == (not expected), res.res
        assert res.res["valid"] is (not expected)


def test_the_local_fleet_files_are_valid(runs):
    for name in ("files/server.yaml", "files/agent.yaml", "hardware/local-gpu0.yaml"):
        assert results(runs[1])[name].status == "ok", results(runs[1])[name].res


def test_every_error_is_reported_with_its_pointer_and_variable(runs):
    for run in runs:
        res = results(run)["bad-server"].res
        by_pointer = {e["pointer"]: e for e in res["errors"]}
        assert set(by_pointer) == {
            "/api/listen/port", "/profiles/0/engine", "/profiles/0/tensor_parallel_size",
            "/deployments/0/replica", "/router/listen/port",
        }
        assert by_pointer["/profiles/0/engine"]["origin"] == "llmgw_profiles[0].engine"
        assert by_pointer["/deployments/0/replica"]["origin"] == "llmgw_deployments[0].replica"
        assert by_pointer["/api/listen/port"]["origin"] == "llmgw_api_port"
        # server.schema.json reaches router.schema.json through the registry.
        assert by_pointer["/router/listen/port"]["origin"] == "llmgw_router.listen.port"
        assert res["msg"].startswith("bad-server: 5 error(s) against the server schema: ")
        assert "/profiles/0/engine (llmgw_profiles[0].engine): 'vlm' is not one of 'vllm', 'sglang', 'llamacpp'" in res["msg"]


def test_unusable_inputs_fail_saying_why(runs):
    for run in runs:
        r = results(run)
        assert r["not-a-mapping"].status == "failed"
        assert r["not-a-mapping"].res["errors"] == [{"pointer": "", "message": "expected object, got list ['node_id']", "origin": None}]
        assert r["unknown-schema"].status == "failed"
        assert "no schema named 'servr'; have " in r["unknown-schema"].res["msg"]
        assert ", server," in r["unknown-schema"].res["msg"]
        assert r["no-schema-dir"].status == "failed"
        assert "cannot list schema directory /nonexistent/schemas" in r["no-schema-dir"].res["msg"]
