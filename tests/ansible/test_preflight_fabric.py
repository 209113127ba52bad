"""The preflight and fabric roles through ansible-playbook on a declared three-host fleet.

A valid fleet passes four times over (check, apply, check, apply), and the
only change is the first run recording each node's adapter identities; an
invalid one fails on the controller naming host, JSON pointer and
the inventory variable to fix; a node whose declared adapter is not ACTIVE fails
the play naming node and adapter while its healthy neighbour passes.
"""

from __future__ import annotations

import copy
import getpass
import grp
import os

import pytest
import yaml

from fleet_harness import FIXTURES, PLAYBOOKS, four_runs, run_playbook

PLAY = PLAYBOOKS / "preflight_fabric.yml"
SYSFS = FIXTURES / "sysfs"


def hardware(node_id):
    return {
        "node_id": node_id,
        "gpu_source": "simulated",
        "gpus": [{"index": i, "uuid": f"GPU-{node_id}-{i}", "name": "NVIDIA H100 80GB HBM3",
                  "memory_bytes": 85520809984, "pci_bus_id": f"00000000:{0x18 + i:02X}:00.0"} for i in range(2)],
    }


FLEET = {
    "all": {
        "vars": {
            "ansible_connection": "local",
            "ansible_python_interpreter": os.sys.executable,
            "llmgw_control_plane_address": "cp.fleet.test",
            "llmgw_gpu_discovery": "simulated",
            "llmgw_models": [{"name": "qwen", "source": "Qwen/Qwen2.5-0.5B-Instruct", "size_bytes": 988097824}],
            "llmgw_profiles": [{"name": "vllm-tp2", "engine": "vllm", "tensor_parallel_size": 2}],
            "llmgw_deployments": [{"model": "qwen", "profile": "vllm-tp2", "replicas": 2}],
            "llmgw_lifecycle": {"heartbeat_interval": 2, "keepalive_interval": 5, "unreachable_after": 15},
            # this machine's own account, as inventory/local does: no system user is created here
            "llmgw_service_user": getpass.getuser(),
            "llmgw_service_group": grp.getgrgid(os.getgid()).gr_name,
            "llmgw_service_user_create": False,
        },
        "children": {
            "llmgw_control_plane": {"hosts": {"cp": None}},
            "llmgw_agents": {
                "hosts": {
                    node: {
                        "llmgw_simulated_hardware": hardware(node),
                        "llmgw_sysfs_root": str(SYSFS / fixture / "class" / "infiniband"),
                        "llmgw_fabrics": [{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_1"], "min_rate_gbps": 100}],
                    }
                    for node, fixture in (("gpu-a1", "healthy"), ("gpu-a2", "mixed_rates"))
                }
            },
        },
    }
}


RECORD = "Write the record (kept as it is once written, unless llmgw_fabric_rerecord)"


def write(tmp_path, fleet):
    """The inventory, with each node's identity record in the test's directory (every "node"
    is this machine)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    fleet = copy.deepcopy(fleet)
    for node, hostvars in fleet["all"]["children"]["llmgw_agents"]["hosts"].items():
        hostvars["llmgw_fabric_identities_file"] = str(tmp_path / node / "fabric-identities.json")
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump(fleet))
    return path


@pytest.fixture(scope="module")
def valid_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
    return four_runs(PLAY, root / "runs", inventory=write(root, FLEET))


@pytest.mark.parametrize("index", range(4), ids=["check", "apply", "check-again", "apply-again"])
def test_a_valid_fleet_passes_and_changes_nothing_but_the_first_record(valid_runs, index):
    run = valid_runs[index]
    assert run.rc == 0 and run.failures() == 0, run.explain()
    recorded_now = {r.host for r in run.task(RECORD) if r.changed}
    # check mode says what the first apply will write; after it, nothing changes
    assert recorded_now == ({"gpu-a1", "gpu-a2"} if index < 2 else set()), run.explain()
    assert {t.split(": ", 1)[1] for t in run.changed_tasks()} <= {RECORD, "Create the configuration directory"}
    validated = {r.host for r in run.task("Validate agent.yaml as declared") if r.status == "ok"}
    assert validated == {"gpu-a1", "gpu-a2"}
    assert [r.host for r in run.task("Validate server.yaml as declared") if r.status == "ok"] == ["cp"]


def test_the_fabric_rate_is_the_slowest_active_link(valid_runs):
    rates = {r.host: r.res["fabric_rate_gbps"] for r in valid_runs[1].task("Validate the declared InfiniBand / RoCE adapters")}
    assert rates == {"gpu-a1": 200.0, "gpu-a2": 100.0}


def test_an_invalid_fleet_fails_before_any_host_is_touched(tmp_path):
    fleet = copy.deepcopy(FLEET)
    fleet["all"]["vars"]["llmgw_profiles"][0]["engine"] = "vlm"
    fleet["all"]["vars"]["llmgw_deployments"].append({"model": "qwen-7b", "profile": "vllm-tp2", "replicas": 1})
    gpu_a2 = fleet["all"]["children"]["llmgw_agents"]["hosts"]["gpu-a2"]
    gpu_a2["llmgw_fabrics"][0]["hcas"] = ["mlx5 0"]
    gpu_a2["llmgw_engine_ports"] = {"first": 80, "last": 20100}
    run = run_playbook(PLAY, tmp_path / "runs", inventory=write(tmp_path, fleet))
    assert run.rc != 0
    failed = {r.host: r.res["msg"] for r in run.results if r.status == "failed"}
    assert set(failed) == {"cp", "gpu-a2"}, run.explain()
    assert failed["cp"].startswith("cp: server.yaml: 1 error(s) against the server schema: ")
    assert failed["cp"].endswith("; cp: llmgw_deployments names model qwen-7b, which llmgw_models does not declare")
    assert "/profiles/0/engine (llmgw_profiles[0].engine): 'vlm' is not one of 'vllm', 'sglang', 'llamacpp'" in failed["cp"]
    assert failed["gpu-a2"].startswith("gpu-a2: agent.yaml: 2 error(s) against the agent schema: ")
    assert "/engine_ports/first (llmgw_engine_ports.first): 80 is less than the minimum of 1024" in failed["gpu-a2"]
    assert "/fabrics/0/hcas/0 (llmgw_fabrics[0].hcas[0]): 'mlx5 0' does not match" in failed["gpu-a2"]
    # gpu-a1 is fine, yet nothing ran on any node: the fabric play never started.
    assert run.task("Validate the declared InfiniBand / RoCE adapters") == []


def test_a_deployment_of_an_undeclared_model_is_refused(tmp_path):
    fleet = copy.deepcopy(FLEET)
    fleet["all"]["vars"]["llmgw_deployments"].append({"model": "qwen-7b", "profile": "vllm-tp4", "replicas": 1})
    run = run_playbook(PLAY, tmp_path / "runs", inventory=write(tmp_path, fleet), limit="cp")
    (failed,) = [r for r in run.results if r.status == "failed"]
    assert failed.res["msg"] == (
        "cp: llmgw_deployments names model qwen-7b, which llmgw_models does not declare; "
        "cp: llmgw_deployments names profile vllm-tp4, which llmgw_profiles does not declare"
    )


def test_router_ejections_reach_server_yaml_and_a_bad_one_names_the_variable(tmp_path):
    fleet = copy.deepcopy(FLEET)
    fleet["all"]["vars"]["llmgw_router_ejections"] = {"min_routers": 0, "sick_after": 30}
    run = run_playbook(PLAY, tmp_path / "runs", inventory=write(tmp_path, fleet), limit="cp")
    (failed,) = [r for r in run.results if r.status == "failed"]
    assert ("/router_ejections/min_routers (llmgw_router_ejections.min_routers): 0 is less than the minimum of 1"
            in failed.res["msg"]), failed.res["msg"]


def test_a_node_whose_adapter_is_not_active_fails_naming_it(tmp_path):
    fleet = copy.deepcopy(FLEET)
    gpu_a2 = fleet["all"]["children"]["llmgw_agents"]["hosts"]["gpu-a2"]
    gpu_a2["llmgw_sysfs_root"] = str(SYSFS / "port_init" / "class" / "infiniband")
    run = run_playbook(PLAY, tmp_path / "runs", inventory=write(tmp_path, fleet))
    assert run.rc != 0
    results = {r.host: r for r in run.task("Validate the declared InfiniBand / RoCE adapters")}
    assert results["gpu-a1"].status == "ok"
    assert results["gpu-a2"].status == "failed"
    msg = results["gpu-a2"].res["msg"]
    assert msg.startswith("gpu-a2: fabric ib-a: mlx5_1: no ACTIVE port (port 1: INIT, phys LinkUp")
