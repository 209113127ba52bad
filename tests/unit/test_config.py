"""Config files: every error named by its JSON pointer, all at once, nothing accepted that would fail later."""

from pathlib import Path

import pytest

from llmgw.config import ConfigInvalid, load_schema, schema_errors
from llmgw.config_cli import validate_file
from llmgw.settings import load_agent_settings, load_server_settings, parse_server_settings

FIX = Path(__file__).parent.parent / "fixtures" / "config"


def errors_of(name):
    return [(e.pointer, e.message) for e in validate_file(FIX / name)]


def test_good_server_file_loads_into_typed_settings():
    s = load_server_settings(FIX / "server-good.yaml")
    assert s.api_port == 8443
    assert s.catalog.models["llama-70b"].served_name == "meta-llama/Llama-3.1-70B-Instruct"
    assert s.catalog.profiles["vllm-tp4"].tensor_parallel_size == 4
    assert [d.replicas for d in s.catalog.deployments] == [2, 1]
    assert s.lifecycle.unreachable_after == 30
    assert s.memory_headroom == 0.2


def test_good_agent_file_loads():
    a = load_agent_settings(FIX / "agent-good.yaml")
    assert a.node_id == "gpu-a1"
    assert a.fabrics[0].hcas == ("mlx5_0", "mlx5_1")
    assert a.fabrics[0].min_rate_gbps == 200
    assert a.model_dir == "/var/lib/llmgw/agent/models"


def test_typo_key_is_named_with_its_path():
    errs = errors_of("server-typo-key.yaml")
    assert len(errs) == 1
    pointer, message = errs[0]
    assert pointer == "/models/0/sourse"
    assert "unknown key" in message and "source" in message


def test_wrong_type_names_the_key_and_expected_type():
    errs = errors_of("server-wrong-type.yaml")
    assert len(errs) == 1
    assert errs[0][0] == "/api/listen/port"
    assert "integer" in errs[0][1] and "'8443'" in errs[0][1]


def test_unknown_engine_lists_the_known_ones():
    errs = errors_of("server-unknown-engine.yaml")
    assert len(errs) == 1
    assert errs[0][0] == "/profiles/0/engine"
    assert "'tensorrt'" in errs[0][1] and "'vllm'" in errs[0][1] and "'sglang'" in errs[0][1]


def test_timing_invariant_broken_is_one_clear_error():
    errs = errors_of("server-timing.yaml")
    assert len(errs) == 1
    assert errs[0][0] == "/lifecycle/unreachable_after"
    assert "keepalive_interval + heartbeat_interval" in errs[0][1]


def test_profile_setting_a_flag_the_adapter_owns_is_refused():
    errs = errors_of("server-owned-flag.yaml")
    assert len(errs) == 1
    assert errs[0][0] == "/profiles/0/extra_args/0"
    assert "--tensor-parallel-size" in errs[0][1]


def test_several_errors_are_reported_at_once():
    pointers = {p for p, _ in errors_of("server-many-errors.yaml")}
    assert {"/api/listen/port", "/models/0/size_bytes", "/profiles/0/tensor_parallel_size",
            "/deployments/0/weight"} <= pointers


def test_references_and_parallel_layout_are_checked():
    errs = dict(errors_of("server-bad-refs.yaml"))
    assert "unknown profile 'nope'" in errs["/deployments/0/profile"]
    assert "unknown model 'ghost'" in errs["/deployments/1/model"]
    assert "cannot be split evenly over nodes=2" in errs["/profiles/0/nodes"]


def test_tls_required_unless_explicitly_insecure():
    doc = {"api": {"listen": {"port": 1}}, "models": [], "profiles": [], "deployments": []}
    with pytest.raises(ConfigInvalid) as e:
        parse_server_settings(doc)
    assert e.value.errors[0].pointer == "/tls"
    assert parse_server_settings({**doc, "insecure_no_tls": True}).tls is None


def test_api_client_bounds_default_and_are_validated_with_their_pointer():
    doc = {"api": {"listen": {"port": 1}}, "models": [], "profiles": [], "deployments": [], "insecure_no_tls": True}
    c = parse_server_settings(doc).api_clients
    assert (c.head_timeout, c.anonymous_timeout, c.max_connections_per_source) == (15, 5, 128)
    set_ = parse_server_settings({**doc, "api": {"listen": {"port": 1}, "clients": {"anonymous_timeout": 0.5}}})
    assert set_.api_clients.anonymous_timeout == 0.5 and set_.api_clients.bounds().head_timeout == 15
    with pytest.raises(ConfigInvalid) as e:
        parse_server_settings({**doc, "api": {"listen": {"port": 1},
                                              "clients": {"head_timeout": 0, "max_connections_per_source": -1}}})
    assert sorted(x.pointer for x in e.value.errors) == ["/api/clients/head_timeout",
                                                         "/api/clients/max_connections_per_source"]


def test_agent_plaintext_url_refused():
    errs = errors_of("agent-plaintext.yaml")
    assert errs == [("/control_plane/url", errs[0][1])]
    assert "wss://" in errs[0][1]


def test_agent_simulated_discovery_needs_a_hardware_file():
    errs = errors_of("agent-simulated-no-file.yaml")
    assert len(errs) == 1 and errs[0][0] == "/discovery"
    assert "hardware_file" in errs[0][1]


def test_yaml_syntax_error_names_the_line(tmp_path):
    f = tmp_path / "server.yaml"
    f.write_text("api:\n  listen: {port: 1\nmodels: []\n")
    errs = validate_file(f, "server")
    assert len(errs) == 1 and "line" in errs[0].message


def test_duplicate_names_refused():
    doc = {
        "api": {"listen": {"port": 1}}, "insecure_no_tls": True,
        "models": [{"name": "m", "source": "a/b"}, {"name": "m", "source": "c/d"}],
        "profiles": [{"name": "p", "engine": "vllm"}],
        "deployments": [],
    }
    with pytest.raises(ConfigInvalid) as e:
        parse_server_settings(doc)
    assert [x.pointer for x in e.value.errors] == ["/models/1/name", "/models/1/served_name"]


@pytest.mark.parametrize("name", ["server", "agent", "router", "hardware", "stream"])
def test_every_object_in_every_schema_forbids_unknown_keys(name):
    def walk(node, path):
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node:
                assert node.get("additionalProperties") is False, f"{name}: {path} allows unknown keys"
            for k, v in node.items():
                walk(v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")

    walk(load_schema(name), "")


def test_stream_message_error_points_into_the_message():
    msg = {"type": "heartbeat", "seq": -1}
    errs = schema_errors(msg, "stream")
    assert any(e.pointer == "/seq" for e in errs)


def test_formats_are_checked():
    doc = {"node_id": "a", "control_plane": {"url": "wss://"}, "state_dir": "/x", "insecure_no_tls": True}
    errs = schema_errors(doc, "agent")
    assert [(e.pointer, e.message) for e in errs] == [("/control_plane/url", "'wss://' is not a 'uri'")]
