"""`llmgw ctl explain` offline: the command an operator runs before deploying."""

import json
from pathlib import Path

from llmgw.cli import main

ROOT = Path(__file__).resolve().parents[2]
HW = ROOT / "tests" / "fixtures" / "hardware"


def run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_local_fleet_places_every_replica_and_prefers_nvlink(capsys):
    cfg = ROOT / "inventory/local/files/server.yaml"
    rc, out, _ = run(capsys, "ctl", "explain", "--config", str(cfg), "--hardware",
                     str(ROOT / "inventory/local/files/hardware/local-gpu0.yaml"), "-o", "json")
    assert rc == 0
    report = json.loads(out)
    assert [r["replica"] for r in report] == [
        "qwen2.5-0.5b-instruct/vllm-tp1#0", "qwen2.5-0.5b-instruct/vllm-tp1#1", "qwen2.5-7b-instruct/vllm-tp2#0"]
    gpus = [g for r in report for s in r["placement"]["shards"] for g in s["gpus"]]
    assert sorted(gpus) == [0, 1, 2, 3]  # every GPU once, none twice
    assert report[2]["placement"]["rule"] == "nvlink"
    assert report[2]["placement"]["shards"][0]["gpus"] == [2, 3]


def test_replica_that_does_not_fit_lists_every_node_and_exits_3(capsys, tmp_path):
    cfg = tmp_path / "server.yaml"
    cfg.write_text(
        "api: {listen: {port: 8443}}\ninsecure_no_tls: true\n"
        "models: [{name: big, source: org/big, size_bytes: 900000000000}]\n"
        "profiles: [{name: tp8, engine: vllm, tensor_parallel_size: 8}]\n"
        "deployments: [{model: big, profile: tp8, replicas: 1}]\n")
    files = sorted(str(p) for p in HW.glob("*.yaml"))
    rc, out, _ = run(capsys, "ctl", "explain", "--config", str(cfg), "--hardware", *files)
    assert rc == 3
    assert "needs 8" in out
    # Every node appears in the explanation with a reason.
    report_rc = main(["ctl", "explain", "--config", str(cfg), "--hardware", *files, "-o", "json"])
    report = json.loads(capsys.readouterr().out)
    assert report_rc == 3
    assert report[0]["placed"] is False
    assert len(report[0]["nodes"]) == len(files)
    assert all(not n["ok"] and n["reason"] for n in report[0]["nodes"])


def test_invalid_config_is_refused_with_pointer(capsys):
    rc, _, err = run(capsys, "ctl", "explain", "--config", str(ROOT / "tests/fixtures/config/server-typo-key.yaml"),
                     "--hardware", str(HW / "hgx-h100-8gpu.yaml"))
    assert rc == 1
    assert "/models/0/sourse" in err


def test_config_validate_exit_codes(capsys):
    rc, out, _ = run(capsys, "config", "validate", str(ROOT / "tests/fixtures/config/server-good.yaml"))
    assert rc == 0 and "valid" in out
    rc, _, err = run(capsys, "config", "validate", "--kind", "server",
                     str(ROOT / "tests/fixtures/config/server-many-errors.yaml"))
    assert rc == 1
    assert "/api/listen/port" in err and "/deployments/0/weight" in err


def test_undeclared_size_is_read_from_a_local_weights_file(capsys, tmp_path):
    weights = tmp_path / "big.gguf"
    with open(weights, "wb") as f:
        f.truncate(200 << 30)  # sparse: 200 GiB that take no disk
    cfg = tmp_path / "server.yaml"
    cfg.write_text(
        "api: {listen: {port: 8443}}\ninsecure_no_tls: true\n"
        f"models: [{{name: big, source: {weights}}}]\n"
        "profiles: [{name: one, engine: llamacpp}, {name: four, engine: llamacpp, tensor_parallel_size: 4}]\n"
        "deployments: [{model: big, profile: one, replicas: 1}, {model: big, profile: four, replicas: 1}]\n")
    rc = main(["ctl", "explain", "--config", str(cfg), "--hardware", str(HW / "hgx-h100-8gpu.yaml"), "-o", "json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 3
    one, four = report
    assert one["weights_bytes"] == four["weights_bytes"] == 200 << 30
    assert not one["placed"]
    assert "group memory too small" in one["nodes"][0]["reason"]
    assert "weights 200.0 GiB" in one["nodes"][0]["reason"]
    assert four["placed"]
    assert "weights 200.0 GiB" in four["placement"]["detail"]
