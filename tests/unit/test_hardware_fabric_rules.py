"""Which declared ports a fabric may use, over sysfs trees in the kernel's format
(tests/fixtures/sysfs, see its README), and the same words at rollout."""

from __future__ import annotations

from pathlib import Path

import pytest
from placement_builders import cap, nvswitch_h100, request

from llmgw.config import ConfigInvalid
from llmgw.hardware.fabric_rules import declaration_errors, roce_v2_gid_index
from llmgw.hardware.infiniband import read_hcas, validate_fabrics
from llmgw.hardware.types import FabricDeclaration, FabricStatus
from llmgw.placement import place
from llmgw.settings import parse_agent_settings

ROOT = Path(__file__).parents[2]
SYSFS = ROOT / "tests" / "fixtures" / "sysfs"
COPY = ROOT / "collections/ansible_collections/llmgw/fleet/plugins/module_utils/fabric_rules.py"


def status(case: str, decl: FabricDeclaration) -> FabricStatus:
    (s,), _ = validate_fabrics([decl], read_hcas(SYSFS / case / "class" / "infiniband"))
    return s


def test_the_collection_applies_this_very_file():
    assert COPY.read_text() == (ROOT / "agent/llmgw/hardware/fabric_rules.py").read_text(), (
        "plugins/module_utils/fabric_rules.py differs: copy agent/llmgw/hardware/fabric_rules.py over it")


def test_roce_beside_infiniband_is_not_advertised():
    s = status("mixed_link_layer", FabricDeclaration("ib-a", ("mlx5_0", "mlx5_1")))
    assert s.advertised_hcas == ("mlx5_0",) and s.link_layer == "InfiniBand"
    assert s.problems == ("mlx5_1: port 1 is Ethernet (RoCE), fabric ib-a is InfiniBand (taken from mlx5_0 port 1): "
                          "InfiniBand and RoCE ports cannot talk to each other; not advertised",)
    declared = status("mixed_link_layer", FabricDeclaration("roce-a", ("mlx5_0", "mlx5_1"), link_layer="Ethernet"))
    assert declared.advertised_hcas == ("mlx5_1",)
    assert "fabric roce-a is Ethernet (RoCE) (declared)" in declared.problems[0]


def test_roce_gid_index_is_read_from_the_gid_table():
    (hca,) = read_hcas(SYSFS / "roce_gid" / "class" / "infiniband")
    assert hca.ports[0].gid_index == 3  # RoCE v2 over IPv4, not index 1 (v2 over the link-local address)
    s = status("roce_gid", FabricDeclaration("roce-a", ("mlx5_0",)))
    assert (s.link_layer, s.gid_index, s.advertised_hcas) == ("Ethernet", 3, ("mlx5_0",))


def test_gid_choice():
    v1, v2 = "IB/RoCE v1", "RoCE v2"
    link_local, ipv4 = "fe80:0000:0000:0000:0e42:a1ff:fe65:3c20", "0000:0000:0000:0000:0000:ffff:0a00:0105"
    assert roce_v2_gid_index({0: (link_local, v1), 1: (link_local, v2)}) == 1
    assert roce_v2_gid_index({0: (link_local, v1), 2: (ipv4, v1)}) is None
    assert roce_v2_gid_index({1: ("0000:0000:0000:0000:0000:0000:0000:0000", v2)}) is None


def test_active_without_linkup_is_refused():
    s = status("phys_recovery", FabricDeclaration("ib-a", ("mlx5_0", "mlx5_1")))
    assert s.advertised_hcas == ("mlx5_0",)
    assert s.problems == ("mlx5_1: port 1 is ACTIVE but phys LinkErrorRecovery: the physical link is not up; "
                          "not advertised",)


def test_ports_are_named_exactly():
    s = status("dualport", FabricDeclaration("ib-a", ("mlx5_0", "mlx5_1")))
    # mlx5_0 lost a rail: NCCL is told the live port only; mlx5_1 has both.
    assert s.advertised_hcas == ("mlx5_0:1", "mlx5_1")
    one = status("dualport", FabricDeclaration("ib-b", ("mlx5_0:2",)))
    assert one.advertised_hcas == () and one.problems[0].startswith("mlx5_0:2: no ACTIVE port (port 2: DOWN, phys Polling)")
    other = status("dualport", FabricDeclaration("ib-b", ("mlx5_1:2",)))
    assert other.advertised_hcas == ("mlx5_1:2",)
    missing = status("dualport", FabricDeclaration("ib-b", ("mlx5_1:3",)))
    assert missing.problems == ("mlx5_1: no port 3 (ports: 1, 2)",)


def test_a_port_claimed_by_two_fabrics_is_refused_with_pointers():
    fabrics = [{"name": "a", "hcas": ["mlx5_0"]}, {"name": "b", "hcas": ["mlx5_0:2", "mlx5_1:1"]},
               {"name": "c", "hcas": ["mlx5_1:1"]}]
    assert declaration_errors(fabrics) == [
        ("/fabrics/1/hcas/0", "mlx5_0:2 is also claimed by fabric a (/fabrics/0/hcas/0): a port carries one fabric"),
        ("/fabrics/2/hcas/0", "mlx5_1:1 is also claimed by fabric b (/fabrics/1/hcas/1): a port carries one fabric"),
    ]
    assert declaration_errors([{"name": "a", "hcas": ["mlx5_0:1"]}, {"name": "b", "hcas": ["mlx5_0:2"]}]) == []
    doc = {"node_id": "n1", "control_plane": {"url": "https://cp:8443"}, "insecure_no_tls": True,
           "state_dir": "/tmp/x", "fabrics": fabrics}
    with pytest.raises(ConfigInvalid) as e:
        parse_agent_settings(doc)
    assert {"/fabrics/1/hcas/0", "/fabrics/2/hcas/0"} <= {x.pointer for x in e.value.errors}


def test_a_renamed_card_is_caught_by_its_recorded_identity():
    # At rollout mlx5_0 was b83f:...:a4e0 and mlx5_1 was ...:a4f8; after a reboot the names swapped.
    ids = (("mlx5_0", (("node_guid", "b83f:d203:0012:a4e0"),)), ("mlx5_1", (("node_guid", "b83f:d203:0012:a4f8"),)))
    s = status("swapped", FabricDeclaration("ib-a", ("mlx5_0",), identities=ids))
    assert s.advertised_hcas == ()
    assert s.problems == (
        "mlx5_0: not the card recorded at rollout (now node GUID b83f:d203:0012:a4f8, PCI 0000:1a:00.0, recorded "
        "node GUID b83f:d203:0012:a4e0); the recorded card is now mlx5_1: renamed at boot? update the declaration",)
    gone = status("renamed", FabricDeclaration("ib-a", ("mlx5_0",), identities=(
        ("mlx5_0", (("node_guid", "b83f:d203:0012:a4e0"),)),)))
    assert gone.problems[0].startswith("mlx5_0: absent; the card recorded as mlx5_0 (node GUID b83f:d203:0012:a4e0) "
                                       "is now mlx5_2")


def test_virtual_functions_with_zero_guids_that_swapped_names_are_told_apart_by_pci_address():
    # At rollout mlx5_0 was the VF at 0000:19:00.0; after a reboot that VF is mlx5_1. Both GUIDs are zero.
    zero = "0000:0000:0000:0000"
    ids = (("mlx5_0", (("node_guid", zero), ("pci_bus_id", "0000:19:00.0"))),
           ("mlx5_1", (("node_guid", zero), ("pci_bus_id", "0000:1a:00.0"))))
    s = status("vf_zero_guid", FabricDeclaration("ib-a", ("mlx5_0", "mlx5_1"), identities=ids))
    assert s.advertised_hcas == ()
    assert s.problems == (
        f"mlx5_0: not the card recorded at rollout (now node GUID {zero}, PCI 0000:1a:00.0, recorded node GUID "
        f"{zero}, PCI 0000:19:00.0); the recorded card is now mlx5_1: renamed at boot? update the declaration",
        f"mlx5_1: not the card recorded at rollout (now node GUID {zero}, PCI 0000:19:00.0, recorded node GUID "
        f"{zero}, PCI 0000:1a:00.0); the recorded card is now mlx5_0: renamed at boot? update the declaration")
    # Recorded where they are now: both usable.
    here = (("mlx5_0", (("node_guid", zero), ("pci_bus_id", "0000:1a:00.0"))),
            ("mlx5_1", (("node_guid", zero), ("pci_bus_id", "0000:19:00.0"))))
    assert status("vf_zero_guid", FabricDeclaration("ib-a", ("mlx5_0", "mlx5_1"), identities=here)).advertised_hcas == (
        "mlx5_0", "mlx5_1")


@pytest.mark.parametrize("recorded,same", [
    ({"node_guid": "b83f:d203:0012:a4e0", "pci_bus_id": "0000:19:00.0"}, True),
    ({"node_guid": "B83F:D203:0012:A4E0"}, True),  # no PCI recorded: the GUID is all there is
    ({"node_guid": "b83f:d203:0012:a4e0", "pci_bus_id": "0000:1a:00.0"}, False),  # equal GUIDs: PCI decides
    ({"node_guid": "b83f:d203:0012:a4f8", "pci_bus_id": "0000:19:00.0"}, False),  # two real GUIDs: two cards
    ({"node_guid": "0000:0000:0000:0000", "pci_bus_id": "0000:19:00.0"}, True),
    ({"pci_bus_id": "0000:1a:00.0"}, False),  # no GUID recorded: PCI decides
])
def test_identity_compares_pci_addresses_whenever_guids_are_missing_zero_or_equal(recorded, same):
    from llmgw.hardware.fabric_rules import check_fabric

    port = {"port": 1, "state": "ACTIVE", "phys_state": "LinkUp", "rate_gbps": 200.0, "rate_text": "200 Gb/sec",
            "link_layer": "InfiniBand", "reason": None, "gid_index": None}
    adapter = {"name": "mlx5_0", "node_guid": "b83f:d203:0012:a4e0", "pci_bus_id": "0000:19:00.0", "ports": [port]}
    status_, _ = check_fabric({"name": "ib-a", "hcas": ["mlx5_0"], "identities": {"mlx5_0": recorded}}, [adapter])
    assert (status_["advertised_hcas"] == ["mlx5_0"]) is same, status_["problems"]


def test_unknown_rate_makes_the_fabrics_rate_unknown():
    s = status("malformed", FabricDeclaration("ib-a", ("mlx5_1",), min_rate_gbps=100))
    assert s.rate_gbps is None and s.advertised_hcas == ("mlx5_1",)
    assert "min_rate_gbps 100 cannot be checked: rate of mlx5_1 port 1 unknown" in s.problems


def _node(name, layer, gid=None):
    f = FabricStatus("fab", ("mlx5_0",), ("mlx5_0",), 100.0, link_layer=layer, gid_index=gid)
    return cap(nvswitch_h100(name, (f,)))


def test_nodes_whose_fabric_differs_in_link_layer_are_never_grouped():
    r = place(request(tp=2, nodes=2), [_node("a", "InfiniBand"), _node("b", "Ethernet", 3)])
    assert r.placement is None
    r = place(request(tp=2, nodes=2), [_node("a", "Ethernet", 3), _node("b", "Ethernet", 1)])
    # each node is told its own RoCE v2 GID index
    assert [s.env for s in r.placement.shards] == [
        {"NCCL_IB_HCA": "=mlx5_0", "NCCL_IB_GID_INDEX": "3"}, {"NCCL_IB_HCA": "=mlx5_0", "NCCL_IB_GID_INDEX": "1"}]
