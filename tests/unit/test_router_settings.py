import pytest

from llmgw.config import ConfigInvalid, schema_errors
from llmgw.router.auth import hash_key
from llmgw.router.settings import RouterSettings

KEY = {"name": "alice", "sha256": hash_key("sk-a"), "models": ["m"]}


def pointers(exc):
    return [e.pointer for e in exc.errors]


def test_defaults():
    s = RouterSettings.from_config({"allow_unauthenticated": True, "insecure_http": True})
    assert (s.host, s.port, s.workers) == ("127.0.0.1", 8080, 1)
    assert s.tls is None and s.insecure_http
    assert s.retries.max_attempts == 3 and s.retries.budget_ratio == 0.2 and s.retries.budget_min == 3
    assert s.balancing.scorer == "least-outstanding" and s.balancing.load_bound == 1.25
    assert s.static_endpoints is None and s.control_plane is None and s.access_log


def test_full_document():
    s = RouterSettings.from_config({
        "listen": {"host": "0.0.0.0", "port": 9000},
        "tls": {"cert": "/etc/llmgw/router.crt", "key": "/etc/llmgw/router.key"},
        "workers": 2,
        "api_keys": [KEY, {"name": "ops", "sha256": hash_key("sk-o")}],
        "static_endpoints": [{"model": "m", "url": "http://127.0.0.1:8000", "max_concurrency": 8},
                             {"id": "b", "model": "m", "url": "http://127.0.0.1:8001", "draining": True}],
        "timeouts": {"connect": 1, "per_try": 5, "total": 50, "first_token": 3, "inter_token": 2},
        "limits": {"max_body_bytes": 2048, "max_concurrency_per_endpoint": 4},
        "balancing": {"scorer": "prefix-affinity", "prefix_tokens": 32, "load_bound": 1.5},
        "retries": {"max_attempts": 2, "budget_ratio": 0.1, "budget_min": 1, "budget_window": 30},
        "outlier": {"consecutive_errors": 2, "base_ejection": 1, "max_ejection": 4, "max_ejection_share": 1},
        "access_log": False,
    })
    assert s.api_keys[0].models == frozenset({"m"}) and s.api_keys[1].models is None
    assert [e.id for e in s.static_endpoints] == ["m@http://127.0.0.1:8000", "b"]
    assert s.static_endpoints[1].draining and s.static_endpoints[0].max_concurrency == 8
    assert s.timeouts.first_token == 3 and s.limits.max_body_bytes == 2048
    assert s.balancing.scorer == "prefix-affinity" and s.outlier.max_ejection_share == 1
    assert s.tls.cert == "/etc/llmgw/router.crt" and not s.insecure_http


def test_no_keys_needs_explicit_open_mode():
    with pytest.raises(ConfigInvalid) as ei:
        RouterSettings.from_config({"insecure_http": True})
    assert pointers(ei.value) == ["/api_keys"]
    assert "allow_unauthenticated" in str(ei.value)


@pytest.mark.parametrize("doc,pointer", [
    ({"retries": {"max_attempts": 4}}, "/retries/max_attempts"),
    ({"api_keys": [{"name": "a", "sha256": "secret-in-clear"}]}, "/api_keys/0/sha256"),
    ({"api_keys": [{"name": "a", "sha256": "0" * 64, "models": "all"}]}, "/api_keys/0/models"),
    ({"balancing": {"scorer": "random"}}, "/balancing/scorer"),
    ({"control_plane": {"url": "http://cp:8443", "ca": "a", "cert": "b", "key": "c"}}, "/control_plane/url"),
    ({"timeouts": {"per_try": 0}}, "/timeouts/per_try"),
    ({"static_endpoints": [{"model": "m", "url": "10.0.0.1:8000"}]}, "/static_endpoints/0/url"),
    ({"colour": "blue"}, "/colour"),
])
def test_schema_errors_name_the_key(doc, pointer):
    doc = {"allow_unauthenticated": True, "insecure_http": True, **doc}
    with pytest.raises(ConfigInvalid) as ei:
        RouterSettings.from_config(doc)
    assert pointer in pointers(ei.value)


def test_cross_field_errors_are_all_reported():
    with pytest.raises(ConfigInvalid) as ei:
        RouterSettings.from_config({
            "api_keys": [KEY, dict(KEY, sha256=hash_key("other")), dict(KEY, name="bob")],
            "static_endpoints": [{"id": "x", "model": "m", "url": "http://h:1"},
                                 {"id": "x", "model": "m", "url": "http://h:2"}],
            "control_plane": {"url": "https://cp:8443", "ca": "a", "cert": "b", "key": "c"},
            "timeouts": {"per_try": 100, "total": 10, "first_token": 5},
            "outlier": {"base_ejection": 50, "max_ejection": 10},
            "insecure_http": True,
        })
    assert set(pointers(ei.value)) == {
        "/api_keys/1/name", "/api_keys/2/sha256", "/control_plane", "/static_endpoints/1/id",
        "/timeouts/per_try", "/outlier/base_ejection"}


def test_static_endpoint_with_an_invalid_port_is_a_config_error_with_its_pointer(tmp_path):
    doc = {"allow_unauthenticated": True, "insecure_http": True,
           "static_endpoints": [{"id": "ok", "model": "m", "url": "http://h:1"},
                                {"id": "x", "model": "m", "url": "http://127.0.0.1:99999"}]}
    with pytest.raises(ConfigInvalid) as ei:
        RouterSettings.from_config(doc)
    assert pointers(ei.value) == ["/static_endpoints/1/url"]
    assert "99999" in str(ei.value)
    # `llmgw config validate --kind router` reports it the same way
    import yaml
    from llmgw.config_cli import validate_file
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert [e.pointer for e in validate_file(path, "router")] == ["/static_endpoints/1/url"]


def test_server_schema_embeds_router_schema():
    errs = schema_errors({"router": {"retries": {"max_attempts": 9}}}, "server")
    assert any(e.pointer == "/router/retries/max_attempts" for e in errs)


def test_plain_http_must_be_chosen_and_never_alongside_tls():
    with pytest.raises(ConfigInvalid) as ei:
        RouterSettings.from_config({"allow_unauthenticated": True})
    assert pointers(ei.value) == ["/tls"]
    assert "insecure_http: true" in str(ei.value) and "llmgw ctl cert router" in str(ei.value)
    with pytest.raises(ConfigInvalid) as ei:
        RouterSettings.from_config({"allow_unauthenticated": True, "insecure_http": True,
                                    "tls": {"cert": "c", "key": "k"}})
    assert pointers(ei.value) == ["/insecure_http"]
    with pytest.raises(ConfigInvalid) as ei:
        RouterSettings.from_config({"allow_unauthenticated": True, "tls": {"cert": "c"}})
    assert pointers(ei.value) == ["/tls"]  # the schema: 'key' is a required property


def test_server_yaml_reports_the_routers_rules_inside_router():
    from llmgw.settings import parse_server_settings
    doc = {"api": {"listen": {"port": 8443}}, "insecure_no_tls": True, "models": [], "profiles": [],
           "deployments": [], "router": {"allow_unauthenticated": True}}
    with pytest.raises(ConfigInvalid) as ei:
        parse_server_settings(doc)
    assert pointers(ei.value) == ["/router/tls"]


def test_client_bounds_and_metrics_tokens():
    base = {"allow_unauthenticated": True, "insecure_http": True}
    s = RouterSettings.from_config({**base, "clients": {"head_timeout": 2, "max_requests_per_key": 0},
                                    "metrics_tokens": [{"name": "prom", "sha256": hash_key("t")}]})
    assert s.clients.head_timeout == 2 and s.clients.max_requests_per_key == 0
    assert s.clients.bounds().head_timeout == 2 and s.metrics_tokens[0].name == "prom"
    d = RouterSettings.from_config(base).clients
    assert (d.head_timeout, d.max_connections_per_source, d.max_body_bytes_per_source) == (15, 1024, 64 << 20)
    with pytest.raises(ConfigInvalid) as e:
        RouterSettings.from_config({**base, "clients": {"head_timeout": 0, "body_min_rate": 0, "extra": 1}})
    assert sorted(pointers(e.value)) == ["/clients/body_min_rate", "/clients/extra", "/clients/head_timeout"]
    with pytest.raises(ConfigInvalid) as e:
        RouterSettings.from_config({**base, "limits": {"max_body_bytes": 1 << 20},
                                    "clients": {"max_body_bytes_per_key": 1 << 19, "max_body_bytes_per_source": 0},
                                    "metrics_tokens": [{"name": "p", "sha256": hash_key("a")},
                                                       {"name": "p", "sha256": hash_key("b")}]})
    assert pointers(e.value) == ["/clients/max_body_bytes_per_key", "/metrics_tokens/1/name"]
