"""``llmgw config validate`` applies the same hardware-file checks as the agent and ``ctl explain``."""

import subprocess
import sys
from pathlib import Path

import yaml

from llmgw.cli import main

HW = Path(__file__).resolve().parents[1] / "fixtures" / "hardware"


def bad_file(tmp_path: Path, name: str = "hardware-bad.yaml") -> Path:
    doc = yaml.safe_load((HW / "pcie-4gpu-nvlink-pairs.yaml").read_text())
    doc["gpus"][3]["index"] = 2  # duplicate index
    doc["gpus"][2]["nvlink_peers"] = doc["gpus"][3]["nvlink_peers"] = []
    doc["gpus"][0]["nvlink_peers"] = [1, 7]  # no GPU 7
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


EXPECTED = [
    "/gpus/0/nvlink_peers/1: no GPU with index 7 in this file",
    "/gpus/3/index: duplicate GPU index 2 (also /gpus/2)",
]


def test_semantic_errors_fail_validate_with_their_pointers(tmp_path, capsys):
    path = bad_file(tmp_path)
    assert main(["config", "validate", "--kind", "hardware", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}: 2 error(s)" in err
    assert all(line in err for line in EXPECTED), err


def test_kind_is_guessed_for_hardware_files_too(tmp_path, capsys):
    path = bad_file(tmp_path, "node.yaml")  # no kind in the name: guessed from "gpus"
    assert main(["config", "validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert all(line in err for line in EXPECTED), err


def test_schema_and_semantic_errors_of_separate_sections_come_together(tmp_path, capsys):
    doc = yaml.safe_load((HW / "ib-a-node1.yaml").read_text())
    doc["gpus"][1]["index"] = 0
    doc["hcas"][0]["ports"][0]["state"] = "ACTVE"
    path = tmp_path / "hardware.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["config", "validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert "/gpus/1/index: duplicate GPU index 0" in err and "/hcas/0/ports/0/state" in err


def test_good_hardware_files_stay_valid(capsys):
    files = sorted(str(p) for p in HW.glob("*.yaml"))
    assert main(["config", "validate", "--kind", "hardware", *files]) == 0


def test_the_installed_command_exits_non_zero(tmp_path):
    path = bad_file(tmp_path)
    r = subprocess.run([sys.executable, "-m", "llmgw", "config", "validate", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert all(line in r.stderr for line in EXPECTED), r.stderr
