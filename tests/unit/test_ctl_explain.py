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
    assert "GPU memory too small" in one["nodes"][0]["reason"]
    assert "weights 200.0 GiB" in one["nodes"][0]["reason"]
    assert four["placed"]
    assert "weights 200.0 GiB" in four["placement"]["detail"]


def test_topology_box_through_the_command_withholds_listed_processes(tmp_path):
    """The real command in its own process: the matrix is shown, the TP=4 group takes whole
    NVLink pairs, and a GPU the file lists a process on is withheld and says so."""
    import subprocess
    import sys

    import yaml

    doc = yaml.safe_load((HW / "pcie-8gpu-bridged-2socket.yaml").read_text())
    doc["gpus"][0]["processes"] = [{"pid": 4242, "used_memory_bytes": 1 << 30}]
    hw = tmp_path / "box.yaml"
    hw.write_text(yaml.safe_dump(doc))
    cfg = tmp_path / "server.yaml"
    cfg.write_text(
        "api: {listen: {port: 8443}}\ninsecure_no_tls: true\n"
        "models: [{name: m, source: org/m, size_bytes: 10000000000}]\n"
        "profiles: [{name: tp4, engine: vllm, tensor_parallel_size: 4}, {name: tp8, engine: vllm, tensor_parallel_size: 8}]\n"
        "deployments: [{model: m, profile: tp4, replicas: 1}, {model: m, profile: tp8, replicas: 1}]\n")
    res = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "explain", "--config", str(cfg), "--hardware", str(hw)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 3, res.stderr
    out = res.stdout
    assert "gpu-pcie8-01 topology (nvidia-smi topo -m):" in out
    assert "GPU0    X       NV4     NODE" in out
    assert "placed (topology): GPUs 4,5,6,7 on gpu-pcie8-01: 2 NVLink islands (4,5 | 6,7) joined by NODE" in out
    assert ("3 free GPUs (GPU 0 withheld: in use by pid 4242 (listed in the hardware file; offline, every listed "
            "process counts), not an llmgw engine), needs 8") in out


def _explain_process(*argv: str):
    """``llmgw ctl explain`` in its own process, as an operator runs it."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "llmgw", "ctl", "explain", *argv],
                          capture_output=True, text=True, timeout=60)


def _tp1_config(tmp_path, replicas: int) -> Path:
    cfg = tmp_path / "server.yaml"
    cfg.write_text(
        "api: {listen: {port: 8443}}\ninsecure_no_tls: true\n"
        "models: [{name: m, source: org/m, size_bytes: 1000000000}]\n"
        "profiles: [{name: tp1, engine: vllm}]\n"
        f"deployments: [{{model: m, profile: tp1, replicas: {replicas}}}]\n")
    return cfg


def test_gpus_whose_health_block_says_unfit_are_withheld_offline_as_the_agent_withholds_them(tmp_path):
    """Xid 79, uncorrected ECC errors and a pending row remap: the agent withholds these GPUs,
    and so does offline explain, by the same function, naming each reason."""
    import yaml

    doc = yaml.safe_load((HW / "pcie-4gpu-nvlink-pairs.yaml").read_text())
    doc["gpus"][0]["health"] = {"xid": [79]}
    doc["gpus"][1]["health"] = {"ecc_uncorrected_volatile": 2}
    doc["gpus"][2]["health"] = {"remapped_rows_pending": True, "xid": [13]}
    hw = tmp_path / "box.yaml"
    hw.write_text(yaml.safe_dump(doc))
    res = _explain_process("--config", str(_tp1_config(tmp_path, 2)), "--hardware", str(hw), "-o", "json")
    assert res.returncode == 3, res.stderr
    first, second = json.loads(res.stdout)
    assert first["placement"]["shards"] == [{"node": "gpu-pcie-01", "rank": 0, "gpus": [3], "env": {}}]
    assert not second["placed"]
    (node,) = second["nodes"]
    assert node["reason"] == (
        "0 free GPUs (GPU 0 withheld: Xid 79 (GPU has fallen off the bus); GPU 1 withheld: 2 uncorrected ECC "
        "error(s) since the last reset; GPU 2 withheld: row remapping pending (takes effect at the next GPU "
        "reset)), needs 1")


def test_two_hardware_files_with_one_node_id_are_an_error_naming_both(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text((HW / "hgx-h100-8gpu.yaml").read_text())
    b.write_text((HW / "hgx-h100-nvswitch-topology.yaml").read_text().replace("node_id: gpu-hgx-01",
                                                                             "node_id: gpu-h100-01"))
    assert "node_id: gpu-h100-01" in b.read_text()
    res = _explain_process("--config", str(_tp1_config(tmp_path, 1)), "--hardware", str(a), str(b))
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert f"duplicate node_id 'gpu-h100-01': {a} and {b} describe the same node" in res.stderr
    assert res.stdout == ""
