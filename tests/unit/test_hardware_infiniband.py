"""RDMA adapters from sysfs trees (tests/fixtures/sysfs) and declared fabrics
checked against them."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from llmgw.hardware.infiniband import (
    SysfsFormatError,
    log_fabric_problems,
    parse_enum_line,
    parse_link_layer,
    parse_phys_state,
    parse_rate,
    parse_state,
    port_from_texts,
    read_hcas,
    validate_fabrics,
)
from llmgw.hardware.types import HCA, FabricDeclaration, IBPort

SYSFS = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"
IB_A = FabricDeclaration(name="ib-a", hcas=("mlx5_0", "mlx5_1"))


def root(case: str) -> Path:
    return SYSFS / case / "class" / "infiniband"


def check(case: str, decl: FabricDeclaration = IB_A):
    statuses, undeclared = validate_fabrics([decl], read_hcas(root(case)))
    (status,) = statuses
    return status, undeclared


def active(name: str, rate: float, text: str, port: int = 1) -> HCA:
    return HCA(name, (IBPort(port, "ACTIVE", "LinkUp", rate, text, "InfiniBand"),))


# --- parsing ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "gbps"),
    [
        ("200 Gb/sec (4X HDR)\n", 200.0),
        ("100 Gb/sec (4X EDR)\n", 100.0),
        ("25 Gb/sec (1X EDR)\n", 25.0),
        ("10 Gb/sec (4X)\n", 10.0),  # SDR has no speed name
        ("2.5 Gb/sec (1X)\n", 2.5),
        ("56 Gb/sec (4X FDR)\n", 56.0),
        ("400 Gb/sec (4X NDR)\n", 400.0),
        ("30 Gb/sec (12X)\n", 30.0),
    ],
)
def test_parse_rate(text, gbps):
    assert parse_rate(text) == (gbps, text.strip())


@pytest.mark.parametrize("text", ["", "\n", "fast\n", "200\n", "200 Gbit/s\n", "Gb/sec (4X HDR)\n"])
def test_parse_rate_rejects_what_the_kernel_does_not_write(text):
    with pytest.raises(SysfsFormatError):
        parse_rate(text)


def test_parse_states():
    assert parse_enum_line("4: ACTIVE\n") == (4, "ACTIVE")
    assert parse_state("5: ACTIVE_DEFER\n") == "ACTIVE_DEFER"
    assert parse_state("2: INIT\n") == "INIT"
    assert parse_phys_state("5: LinkUp\n") == "LinkUp"
    assert parse_phys_state("7: Phy Test\n") == "Phy Test"
    assert parse_link_layer("Ethernet\n") == "Ethernet"
    for bad in ("", "ACTIVE\n", "4 ACTIVE\n", "x: ACTIVE\n", "4: BOGUS\n"):
        with pytest.raises(SysfsFormatError):
            parse_state(bad)
    with pytest.raises(SysfsFormatError):
        parse_link_layer("Omni-Path\n")


def test_port_from_texts_reports_each_bad_file():
    p = port_from_texts(1, {
        "state": "4: ACTIVE\n",
        "phys_state": PermissionError(13, "Permission denied"),
        "rate": "fast\n",
    })
    assert p.state == "ACTIVE" and p.phys_state == "UNKNOWN"
    assert (p.rate_gbps, p.rate_text, p.link_layer) == (0.0, "", "Unknown")
    assert "phys_state: cannot read (Permission denied)" in p.reason
    assert "rate: expected" in p.reason and "'fast'" in p.reason
    assert "link_layer: missing" in p.reason


# --- reading trees ----------------------------------------------------------------


def test_healthy_tree_follows_symlinks_into_devices():
    assert os.path.islink(root("healthy") / "mlx5_0")
    hcas = read_hcas(root("healthy"))
    assert [h.name for h in hcas] == ["mlx5_0", "mlx5_1"]
    for h in hcas:
        assert h.ports == (IBPort(1, "ACTIVE", "LinkUp", 200.0, "200 Gb/sec (4X HDR)", "InfiniBand"),)
    status, undeclared = check("healthy")
    assert status.advertised_hcas == ("mlx5_0", "mlx5_1")
    assert status.rate_gbps == 200.0 and status.problems == () and undeclared == ()


def test_missing_adapter():
    status, _ = check("missing_adapter")
    assert status.advertised_hcas == ("mlx5_0",)
    assert status.problems == ("mlx5_1: absent (found: mlx5_0)",)


def test_renamed_adapter_is_absent_and_its_new_name_undeclared():
    status, undeclared = check("renamed")
    assert status.advertised_hcas == ("mlx5_1",)
    assert status.problems == ("mlx5_0: absent (found: mlx5_1, mlx5_2)",)
    assert undeclared == ("mlx5_2",)


@pytest.mark.parametrize(
    ("case", "detail", "hint"),
    [
        ("port_init", "(port 1: INIT, phys LinkUp)", "no subnet manager"),
        ("port_down", "(port 1: DOWN, phys Polling)", "check the cable"),
        ("port_armed", "(port 1: ARMED, phys LinkUp)", "not finished activating"),
    ],
)
def test_port_not_active_is_not_advertised(case, detail, hint):
    status, _ = check(case)
    assert status.advertised_hcas == ("mlx5_0",)
    (problem,) = status.problems
    assert problem.startswith(f"mlx5_1: no ACTIVE port {detail}")
    assert hint in problem
    assert status.rate_gbps == 200.0  # only the advertised adapter counts


def test_mixed_rates_fabric_runs_at_the_slowest_link():
    status, _ = check("mixed_rates")
    assert status.advertised_hcas == ("mlx5_0", "mlx5_1")
    assert status.rate_gbps == 100.0 and status.problems == ()


def test_min_rate_not_met_is_reported_but_still_advertised():
    decl = FabricDeclaration("ib-a", ("mlx5_0", "mlx5_1"), min_rate_gbps=200)
    status, _ = check("mixed_rates", decl)
    assert status.advertised_hcas == ("mlx5_0", "mlx5_1") and status.usable
    (problem,) = status.problems
    assert "rate 100 Gb/s is below min_rate_gbps 200" in problem
    assert "mlx5_1 port 1, 100 Gb/sec (4X EDR)" in problem
    ok, _ = check("healthy", decl)
    assert ok.problems == ()


def test_roce_adapter():
    hcas = read_hcas(root("roce"))
    port = IBPort(1, "ACTIVE", "LinkUp", 100.0, "100 Gb/sec (4X EDR)", "Ethernet")
    # Where the card sits comes from the class symlink into devices/; the
    # fixture has no numa_node file, so the NUMA node stays unknown.
    assert hcas == (HCA("mlx5_bond_0", (port,), pci_bus_id="0000:3b:00.0",
                        pci_path=("pci0000:3a", "0000:3a:00.0", "0000:3b:00.0"), numa_node=None,
                        node_guid="0c42:a103:0065:3c20"),)
    status, undeclared = check("roce", FabricDeclaration("roce-a", ("mlx5_bond_0",)))
    assert status.advertised_hcas == ("mlx5_bond_0",) and status.rate_gbps == 100.0
    assert undeclared == ()


def test_multiport_adapter_with_one_active_port_is_usable():
    (hca,) = read_hcas(root("multiport"))
    assert [(p.port, p.state, p.phys_state, p.rate_gbps) for p in hca.ports] == [
        (1, "ACTIVE", "LinkUp", 56.0),
        (2, "DOWN", "Disabled", 10.0),
    ]
    status, _ = check("multiport", FabricDeclaration("ib-old", ("mlx4_0",)))
    # Named as NCCL_IB_HCA must name it: the one ACTIVE port, not the whole card.
    assert status.advertised_hcas == ("mlx4_0:1",)
    assert status.rate_gbps == 56.0  # the down port is not a link of the fabric
    assert status.problems == ()


def test_malformed_files_give_unknown_with_reasons_never_a_crash():
    by_name = {h.name: h for h in read_hcas(root("malformed"))}
    (p0,) = by_name["mlx5_0"].ports
    assert (p0.state, p0.phys_state, p0.rate_gbps) == ("UNKNOWN", "UNKNOWN", 0.0)
    assert "state:" in p0.reason and "rate:" in p0.reason
    (p1,) = by_name["mlx5_1"].ports
    assert p1.state == "ACTIVE" and p1.reason == "rate: missing"

    status, _ = check("malformed", FabricDeclaration("ib-a", ("mlx5_0", "mlx5_1"), min_rate_gbps=100))
    assert status.advertised_hcas == ("mlx5_1",)
    assert status.rate_gbps is None
    assert status.problems[0].startswith("mlx5_0: no ACTIVE port (port 1: UNKNOWN, phys UNKNOWN [state:")
    assert ("mlx5_1: port 1 is ACTIVE but its rate is unknown [rate: missing]; the fabric's rate is unknown"
            in status.problems)
    assert "min_rate_gbps 100 cannot be checked: rate of mlx5_1 port 1 unknown" in status.problems


def test_unreadable_files_and_adapters(tmp_path):
    # A directory where a file should be fails to read as EISDIR, which works
    # as root too (permission bits do not stop root).
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").mkdir()
    (port / "phys_state").write_text("5: LinkUp\n")
    (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    (port / "link_layer").write_text("InfiniBand\n")
    (tmp_path / "mlx5_1").symlink_to(tmp_path / "gone")  # driver unbound: dangling link
    (tmp_path / "mlx5_0" / "ports" / "lost+found").mkdir()  # not a port number: ignored
    hcas = read_hcas(tmp_path)
    assert [h.name for h in hcas] == ["mlx5_0", "mlx5_1"]
    (p,) = hcas[0].ports
    assert p.state == "UNKNOWN" and p.phys_state == "LinkUp"
    assert p.reason.startswith("state: cannot read (")
    assert hcas[1].ports == ()
    (status,), _ = validate_fabrics([IB_A], hcas)
    assert status.advertised_hcas == ()
    assert status.problems[0].startswith("mlx5_0: no ACTIVE port (port 1: UNKNOWN, phys LinkUp [state: cannot read")
    assert status.problems[1] == "mlx5_1: no ACTIVE port (no ports found)"


def test_no_rdma_driver_means_no_adapters(tmp_path):
    assert read_hcas(tmp_path / "absent") == ()
    status, undeclared = validate_fabrics([IB_A], ())
    assert status[0].problems == ("mlx5_0: absent (found: none)", "mlx5_1: absent (found: none)")
    assert not status[0].usable and status[0].rate_gbps is None and undeclared == ()


# --- validate_fabrics over types ----------------------------------------------------


def test_natural_order_and_undeclared():
    hcas = [active(n, 200.0, "200 Gb/sec (4X HDR)") for n in ("mlx5_10", "mlx5_2", "mlx5_0")]
    statuses, undeclared = validate_fabrics([FabricDeclaration("f", ("mlx5_1",))], hcas)
    assert statuses[0].problems == ("mlx5_1: absent (found: mlx5_0, mlx5_2, mlx5_10)",)
    assert undeclared == ("mlx5_0", "mlx5_2", "mlx5_10")


def test_several_fabrics_and_duplicate_names():
    hcas = [active("mlx5_0", 200.0, "200 Gb/sec (4X HDR)"), active("mlx5_1", 400.0, "400 Gb/sec (4X NDR)")]
    decls = [FabricDeclaration("a", ("mlx5_0", "mlx5_0")), FabricDeclaration("b", ("mlx5_1",))]
    statuses, undeclared = validate_fabrics(decls, hcas)
    assert [(s.name, s.declared_hcas, s.advertised_hcas, s.rate_gbps) for s in statuses] == [
        ("a", ("mlx5_0",), ("mlx5_0",), 200.0),
        ("b", ("mlx5_1",), ("mlx5_1",), 400.0),
    ]
    assert undeclared == ()


def test_each_problem_is_logged_at_warning(caplog):
    caplog.set_level(logging.WARNING)
    renamed, _ = check("renamed")
    (unusable,), _ = validate_fabrics([FabricDeclaration("ib-b", ("mlx5_9",))], read_hcas(root("renamed")))
    log_fabric_problems([renamed, unusable])
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert messages == [
        "fabric ib-a: mlx5_0: absent (found: mlx5_1, mlx5_2)",
        "fabric ib-b (not advertised: no usable adapter): mlx5_9: absent (found: mlx5_1, mlx5_2)",
    ]
