"""``llmgw config validate --kind router`` applies the router's own rules, not only its schema."""

from pathlib import Path

import yaml

from llmgw.cli import main


def write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_semantic_errors_fail_validate_with_their_pointers(tmp_path, capsys):
    key = {"name": "a", "sha256": "0" * 64}
    path = write(tmp_path, {
        "listen": {"host": "127.0.0.1", "port": 9000},
        "api_keys": [key, {**key}],  # schema-valid, but the same name and hash twice
        "static_endpoints": [{"id": "e", "model": "m", "url": "http://127.0.0.1:1"}],
    })
    assert main(["config", "validate", "--kind", "router", str(path)]) == 1
    err = capsys.readouterr().err
    assert "/api_keys/1/name: duplicate key name 'a' (also /api_keys/0)" in err
    assert "/api_keys/1/sha256: same key hash as /api_keys/0" in err


def test_a_valid_router_file_passes(tmp_path, capsys):
    path = write(tmp_path, {"listen": {"host": "127.0.0.1", "port": 9000}, "allow_unauthenticated": True,
                            "insecure_http": True,
                            "static_endpoints": [{"id": "e", "model": "m", "url": "http://127.0.0.1:1"}]})
    assert main(["config", "validate", str(path)]) == 0
    assert f"{path}: valid" in capsys.readouterr().out
