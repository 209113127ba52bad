"""The production sample inventory is a valid fleet: it passes preflight (the
runtime's schemas and the reference checks) for every host without touching one,
and it has the shape it documents (two racks on separate fabrics, vLLM and SGLang).
"""

from __future__ import annotations

import json
import os
import subprocess

import yaml

from fleet_harness import BIN, PLAYBOOKS, REPO, run_playbook

PRODUCTION = REPO / "inventory" / "production.example"


def test_the_production_sample_passes_preflight(tmp_path):
    run = run_playbook(PLAYBOOKS / "preflight.yml", tmp_path / "runs", inventory=PRODUCTION / "hosts.yml", check=True)
    assert run.rc == 0, run.explain()
    assert run.changed() == 0, run.explain()
    servers = run.task("Validate server.yaml as declared")
    agents = run.task("Validate agent.yaml as declared")
    assert [r.host for r in servers if r.status == "ok"] == ["llmgw-cp1"]
    assert sorted(r.host for r in agents if r.status == "ok") == ["gpu-r1-n1", "gpu-r1-n2", "gpu-r2-n1", "gpu-r2-n2"]
    assert all(r.res["valid"] for r in servers + agents if r.status == "ok"), run.explain()


def _groups():
    out = subprocess.run(
        [str(BIN / "ansible-inventory"), "-i", str(PRODUCTION / "hosts.yml"), "--list", "--export"],
        check=True, capture_output=True, text=True, cwd=REPO,
        env={**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg")},
    )
    return json.loads(out.stdout)


def test_the_production_sample_declares_two_racks_on_separate_fabrics():
    inv = _groups()
    assert set(inv["llmgw_agents"]["children"]) == {"rack1", "rack2"}
    assert inv["rack1"]["hosts"] == ["gpu-r1-n1", "gpu-r1-n2"] and inv["rack2"]["hosts"] == ["gpu-r2-n1", "gpu-r2-n2"]
    engines = {p["engine"] for p in yaml.safe_load((PRODUCTION / "group_vars" / "all" / "fleet.yml").read_text())["llmgw_profiles"]}
    assert engines == {"vllm", "sglang", "llamacpp"}


def test_the_production_sample_fetches_only_single_files_that_its_engines_can_load():
    """A URL source is fetched as exactly one file and never unpacked: the sample must not
    point an engine at an archive, and a fetched file is a GGUF served by llama.cpp (the one
    engine that loads a single file); checkpoints of several files are paths or hub ids."""
    fleet = yaml.safe_load((PRODUCTION / "group_vars" / "all" / "fleet.yml").read_text())
    engine = {p["name"]: p["engine"] for p in fleet["llmgw_profiles"]}
    urls = {m["name"]: m["source"] for m in fleet["llmgw_models"] if "://" in m["source"]}
    assert urls, "the sample shows no URL source"
    for name, url in urls.items():
        assert url.startswith("https://") and url.endswith(".gguf"), (name, url)
        assert {engine[d["profile"]] for d in fleet["llmgw_deployments"] if d["model"] == name} == {"llamacpp"}, name
    archives = (".tar", ".tar.gz", ".tgz", ".zip", ".tar.zst")
    assert [m["source"] for m in fleet["llmgw_models"] if m["source"].endswith(archives)] == []
    node = yaml.safe_load((PRODUCTION / "group_vars" / "llmgw_agents" / "node.yml").read_text())
    assert set(engine.values()) <= set(node["llmgw_engines"])  # every engine the catalog uses has a command

