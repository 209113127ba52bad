"""``llmgw ctl keys`` and the router's keys file: what is written, what is refused, what the router loads."""

from __future__ import annotations

import stat

import pytest
import yaml

from llmgw.config import ConfigInvalid
from llmgw.ctl.keys import main
from llmgw.router.auth import KeyRing, hash_key
from llmgw.router.cli import load


def create(capsys, keys, *args):
    assert main(["keys", "create", *args, "--file", str(keys)]) == 0
    return capsys.readouterr().out.strip()


def test_create_prints_the_key_once_and_writes_only_its_digest_0600(tmp_path, capsys):
    keys = tmp_path / "keys.yaml"
    key = create(capsys, keys, "alice", "--models", "m", "n", "--tokens-per-minute", "5000",
                 "--default-max-tokens", "64")
    doc = yaml.safe_load(keys.read_text())
    assert doc == {"api_keys": [{"name": "alice", "sha256": hash_key(key), "models": ["m", "n"],
                                 "limits": {"tokens_per_minute": 5000, "default_max_tokens": 64}}]}
    assert key not in keys.read_text() and stat.S_IMODE(keys.stat().st_mode) == 0o600
    assert create(capsys, keys, "bob") != key  # a fresh secret each time
    assert [k["name"] for k in yaml.safe_load(keys.read_text())["api_keys"]] == ["alice", "bob"]


def test_an_existing_file_keeps_its_mode(tmp_path, capsys):
    keys = tmp_path / "keys.yaml"
    keys.write_text("api_keys: []\n")
    keys.chmod(0o640)  # as Ansible leaves it, for the router's group
    create(capsys, keys, "alice")
    assert stat.S_IMODE(keys.stat().st_mode) == 0o640


def test_a_duplicate_name_or_a_bad_limit_is_refused_with_its_pointer_and_nothing_written(tmp_path, capsys):
    keys = tmp_path / "keys.yaml"
    create(capsys, keys, "alice")
    before = keys.read_text()
    assert main(["keys", "create", "alice", "--file", str(keys)]) == 1
    assert "a key named 'alice' exists" in capsys.readouterr().err
    assert main(["keys", "create", "bob", "--file", str(keys), "--tokens-per-minute", "10"]) == 1
    err = capsys.readouterr()
    assert "/api_keys/1/limits/tokens_per_minute: 10 is below default_max_tokens" in err.err and err.out == ""
    assert main(["keys", "create", "bad name", "--file", str(keys)]) == 1
    assert "/api_keys/1/name" in capsys.readouterr().err
    assert main(["keys", "create", "carol", "--file", str(keys), "--cached-prompt-weight", "1.5"]) == 1
    assert "/api_keys/1/limits/cached_prompt_weight" in capsys.readouterr().err
    assert keys.read_text() == before
    create(capsys, keys, "carol", "--cached-prompt-weight", "0.1")
    assert yaml.safe_load(keys.read_text())["api_keys"][1]["limits"] == {"cached_prompt_weight": 0.1}


def test_revoke_removes_the_key_and_an_unknown_name_is_an_error(tmp_path, capsys):
    keys = tmp_path / "keys.yaml"
    create(capsys, keys, "alice")
    create(capsys, keys, "bob")
    assert main(["keys", "revoke", "alice", "--file", str(keys)]) == 0
    assert [k["name"] for k in yaml.safe_load(keys.read_text())["api_keys"]] == ["bob"]
    assert main(["keys", "revoke", "alice", "--file", str(keys)]) == 1
    assert "no key named 'alice'" in capsys.readouterr().err


def test_list_shows_names_models_and_limits_never_digests(tmp_path, capsys):
    keys = tmp_path / "keys.yaml"
    create(capsys, keys, "alice", "--models", "m", "--requests-per-minute", "5")
    digest = yaml.safe_load(keys.read_text())["api_keys"][0]["sha256"]
    assert main(["keys", "list", "--file", str(keys)]) == 0
    out = capsys.readouterr().out
    assert "alice" in out and "requests_per_minute=5" in out and digest not in out
    assert main(["keys", "list", "--file", str(keys), "--json"]) == 0
    out = capsys.readouterr().out
    assert '"name": "alice"' in out and digest not in out


def test_an_invalid_keys_file_is_left_alone_and_named_by_pointer(tmp_path, capsys):
    keys = tmp_path / "keys.yaml"
    keys.write_text("api_keys:\n- name: alice\n  sha256: nothex\n")
    assert main(["keys", "create", "bob", "--file", str(keys)]) == 1
    err = capsys.readouterr().err
    assert f"{keys}" in err and "/api_keys/0/sha256" in err
    assert "nothex" in keys.read_text() and "bob" not in keys.read_text()


def _router_yaml(tmp_path, **doc):
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({"insecure_http": True, "static_endpoints": [], **doc}))
    return str(path)


def test_the_router_loads_keys_from_its_keys_file_beside_router_yaml(tmp_path, capsys):
    key = create(capsys, tmp_path / "keys.yaml", "alice", "--models", "m")
    settings, _ = load(_router_yaml(tmp_path, api_keys_file="keys.yaml",
                                    api_keys=[{"name": "ops", "sha256": hash_key("sk-ops")}]))
    assert [k.name for k in settings.api_keys] == ["ops", "alice"]
    ring = KeyRing(settings.api_keys, allow_unauthenticated=False)
    assert ring.authenticate(f"Bearer {key}").name == "alice"


def test_an_empty_keys_file_is_a_router_that_accepts_no_key(tmp_path):
    (tmp_path / "keys.yaml").write_text("api_keys: []\n")
    settings, _ = load(_router_yaml(tmp_path, api_keys_file="keys.yaml"))
    assert settings.api_keys == ()  # the last key revoked: every request gets 401, not an open router


def test_the_router_names_the_keys_file_and_pointer_of_a_bad_entry_or_a_name_in_both_files(tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"api_keys": [{"name": "x", "sha256": "0" * 64, "limits": {"concurrent_requests": 0}}]}))
    with pytest.raises(ConfigInvalid) as e:
        load(_router_yaml(tmp_path, api_keys_file=str(keys)))
    assert e.value.source == str(keys) and [x.pointer for x in e.value.errors] == ["/api_keys/0/limits/concurrent_requests"]
    keys.write_text(yaml.safe_dump({"api_keys": [{"name": "ops", "sha256": "0" * 64}]}))
    with pytest.raises(ConfigInvalid) as e:
        load(_router_yaml(tmp_path, api_keys_file=str(keys), api_keys=[{"name": "ops", "sha256": "1" * 64}]))
    assert e.value.errors[0].pointer == "/api_keys/0/name" and "also in" in e.value.errors[0].message
    with pytest.raises(ConfigInvalid) as e:
        load(_router_yaml(tmp_path, api_keys_file="missing.yaml"))
    assert e.value.source.endswith("missing.yaml") and "cannot read" in str(e.value)


def test_the_in_process_router_refuses_a_keys_file_or_usage_record_it_would_not_keep():
    from types import SimpleNamespace

    from llmgw.controlplane.server import RouterHook
    from llmgw.controlplane.startup import StartupRefused

    with pytest.raises(StartupRefused, match="/router/api_keys_file"):
        RouterHook(SimpleNamespace(router={"insecure_http": True, "api_keys_file": "keys.yaml"}, tls=None))
    with pytest.raises(StartupRefused, match="/router/usage_log"):
        RouterHook(SimpleNamespace(router={"insecure_http": True, "allow_unauthenticated": True,
                                           "usage_log": "usage.jsonl"}, tls=None))


def test_config_validate_reads_the_keys_file_and_names_a_clash_at_api_keys_file(tmp_path, capsys):
    from llmgw.config_cli import validate_file

    (tmp_path / "keys.yaml").write_text(yaml.safe_dump({"api_keys": [{"name": "ops", "sha256": "0" * 64}]}))
    clean = _router_yaml(tmp_path, api_keys_file="keys.yaml")
    assert validate_file(clean, "router") == []
    clash = _router_yaml(tmp_path, api_keys_file="keys.yaml", api_keys=[{"name": "ops", "sha256": "1" * 64}])
    [err] = validate_file(clash, "router")
    assert err.pointer == "/api_keys_file" and "keys.yaml: /api_keys/0/name: key 'ops' is also in" in err.message
