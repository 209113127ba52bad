"""The fabric role records each declared adapter's identity at the first rollout and
holds later runs, and the agent, to it: a reboot that swaps two cards' names is
caught by name, and a card replaced on purpose is recorded again only when asked."""

from __future__ import annotations

import getpass
import grp
import json
import os

from fleet_harness import FIXTURES, PLAYBOOKS, run_playbook

SYSFS = FIXTURES / "sysfs"
FABRICS = [{"name": "ib0", "hcas": ["mlx5_0", "mlx5_1:1"]}]


def run(tmp_path, fixture, *, check=False, rerecord=False, playbook="fabric_role.yml"):
    return run_playbook(PLAYBOOKS / playbook, tmp_path / "runs", check=check, diff=True, extravars={
        "llmgw_fabrics": FABRICS, "llmgw_sysfs_root": str(SYSFS / fixture / "class" / "infiniband"),
        "llmgw_fabric_identities_file": str(tmp_path / "etc" / "fabric-identities.json"),
        "llmgw_fabric_rerecord": rerecord, "llmgw_prefix": str(tmp_path),
        # this machine's own account, as inventory/local does: no system user is created here
        "llmgw_service_user": getpass.getuser(), "llmgw_service_group": grp.getgrgid(os.getgid()).gr_name,
        "llmgw_service_user_create": False})


def agent_fabrics(result):
    (shown,) = result.task("Show the agent configuration's fabrics")
    return shown.res["llmgw_agent_config.fabrics"]


def test_identities_are_recorded_once_checked_after_and_recorded_again_only_when_asked(tmp_path):
    record = tmp_path / "etc" / "fabric-identities.json"

    first_check = run(tmp_path, "healthy", check=True)
    assert first_check.rc == 0 and not record.exists(), first_check.explain()
    assert first_check.task("Write the record (kept as it is once written, unless llmgw_fabric_rerecord)")[0].changed

    first = run(tmp_path, "healthy")
    assert first.rc == 0, first.explain()
    recorded = json.loads(record.read_text())
    assert sorted(recorded) == ["mlx5_0", "mlx5_1"]  # the cards, whether declared whole or by port
    assert all(set(v) == {"node_guid", "pci_bus_id"} for v in recorded.values())
    # the agent gets the same record, so it checks the cards on every discovery
    assert agent_fabrics(first) == [{**FABRICS[0], "identities": recorded}]

    again = run(tmp_path, "healthy")
    assert again.rc == 0 and again.changed() == 0, again.explain()

    # after a reboot that swapped the two cards' names: refused, naming where each card went
    swapped = run(tmp_path, "swapped")
    assert swapped.rc != 0
    (failed,) = [r for r in swapped.results if r.status == "failed"]
    assert failed.task == "Validate the declared InfiniBand / RoCE adapters", swapped.explain()
    assert "mlx5_0" in failed.res["msg"] and "mlx5_1" in failed.res["msg"], failed.res["msg"]
    assert json.loads(record.read_text()) == recorded  # the record is not rewritten by a failed check

    # the operator says the change is intended: recorded afresh, and the next plain run holds to it
    accepted = run(tmp_path, "swapped", rerecord=True)
    assert accepted.rc == 0, accepted.explain()
    now = json.loads(record.read_text())
    assert now["mlx5_0"]["node_guid"] == recorded["mlx5_1"]["node_guid"]
    assert now["mlx5_1"]["node_guid"] == recorded["mlx5_0"]["node_guid"]
    assert run(tmp_path, "swapped").changed() == 0


def test_a_run_without_the_fabric_role_still_gives_the_agent_the_record(tmp_path):
    """playbooks/upgrade.yml runs the agent role alone: agent.yaml must keep the identities."""
    before = run(tmp_path, "healthy", playbook="agent_fabric_record.yml")
    assert before.rc == 0, before.explain()
    assert agent_fabrics(before) == FABRICS  # nothing recorded yet: as declared

    assert run(tmp_path, "healthy").rc == 0
    recorded = json.loads((tmp_path / "etc" / "fabric-identities.json").read_text())
    alone = run(tmp_path, "healthy", playbook="agent_fabric_record.yml")
    assert alone.rc == 0, alone.explain()
    assert agent_fabrics(alone) == [{**FABRICS[0], "identities": recorded}]
