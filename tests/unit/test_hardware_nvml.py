"""GPU discovery through NVML, against a stand-in for the ``pynvml`` module.

This machine has no GPU, so ``FakeNvml`` plays the bindings: the same
function names and signatures, the real ``pynvml`` constants and exception
classes (raised as ``pynvml.NVMLError(code)``, which the bindings map to
their subclasses), and return values of the real ctypes structures
(``c_nvmlMemory_t``, ``nvmlPciInfo_t``) or, for older bindings, bytes.
"""

from __future__ import annotations

import logging

import pynvml
import pytest
from nvml_fake import Dev, FakeNvml, bus, hgx_a100, warnings_of

from llmgw.hardware import nvml as nvml_mod
from llmgw.hardware.nvml import LinkReport, discover_gpus, normalize_bus_id, nvlink_peers


@pytest.fixture(autouse=True)
def _fresh_warnings():
    nvml_mod._reset_warnings()
    yield
    nvml_mod._reset_warnings()


# --- the fake is the real API ------------------------------------------------


def test_real_pynvml_maps_codes_to_the_subclasses_the_fake_raises():
    assert isinstance(pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND), pynvml.NVMLError_LibraryNotFound)
    assert isinstance(pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED), pynvml.NVMLError_NotSupported)
    fake = FakeNvml([Dev(bus(0x1B))])
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetPciInfo(h).busId == "00000000:1B:00.0"  # nvmlPciInfo_t decodes to str
    assert fake.nvmlDeviceGetMemoryInfo(h).total == 85520809984
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetNvLinkState(h, 0)


# --- no NVML ----------------------------------------------------------------


def test_no_library_gives_no_gpus_and_a_reason_logged_once(caplog):
    fake = FakeNvml([Dev(bus(1))], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    caplog.set_level(logging.WARNING)
    first = discover_gpus(fake)
    second = discover_gpus(fake)
    assert first.gpus == () and second.gpus == ()
    assert "libnvidia-ml.so.1" in first.reason and "not found" in first.reason
    assert first.nvlink_known is False
    assert warnings_of(caplog) == [f"0 GPUs: {first.reason}"]
    assert fake.shutdowns == 0  # init never succeeded: nothing to shut down


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver not loaded"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "Insufficient Permissions"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "NVMLError_LibRmVersionMismatch"),
        (pynvml.NVMLLibraryMismatchError("libnvidia-ml too old"), "libnvidia-ml too old"),
        (OSError(5, "Input/output error"), "Input/output error"),
    ],
)
def test_init_failure_never_raises(caplog, error, expected):
    caplog.set_level(logging.WARNING)
    result = discover_gpus(FakeNvml([Dev(bus(1))], init_error=error))
    assert result.gpus == ()
    assert expected in result.reason
    assert warnings_of(caplog) == [f"0 GPUs: {result.reason}"]


def test_query_failure_after_init_still_shuts_down():
    fake = FakeNvml([Dev(bus(1))], count_error=pynvml.NVML_ERROR_UNKNOWN)
    result = discover_gpus(fake)
    assert result.gpus == ()
    assert "Unknown Error" in result.reason
    assert (fake.inits, fake.shutdowns, fake.initialised) == (1, 1, 0)


def test_no_devices():
    fake = FakeNvml([])
    result = discover_gpus(fake)
    assert result.gpus == () and result.reason == "NVML sees no GPUs"
    assert fake.shutdowns == 1


def test_real_bindings_on_this_machine_never_raise():
    result = discover_gpus()
    if result.gpus:  # a machine with a driver
        assert result.reason is None
    else:
        assert result.reason


# --- GPUs and topology --------------------------------------------------------


def test_two_gpus_bridged_report_each_other_and_their_facts():
    # Remote ids in the legacy 4-digit-domain form: matched after normalising.
    d0 = Dev(bus(0x17), links={0: "0000:65:00.0", 1: "0000:65:00.0", 2: None})
    d1 = Dev(bus(0x65), links={0: "0000:17:00.0", 1: "0000:17:00.0"})
    fake = FakeNvml([d0, d1])
    result = discover_gpus(fake)
    assert result.reason is None and result.nvlink_known is True
    g0, g1 = result.gpus
    assert (g0.index, g0.pci_bus_id, g0.nvlink_peers) == (0, "00000000:17:00.0", (1,))
    assert (g1.index, g1.pci_bus_id, g1.nvlink_peers) == (1, "00000000:65:00.0", (0,))
    assert g0.name == "NVIDIA H100 80GB HBM3" and g0.memory_bytes == 85520809984
    assert g0.uuid == d0.uuid
    assert fake.shutdowns == 1 and fake.initialised == 0


def test_old_bindings_returning_bytes():
    d0 = Dev(bus(0x17), name="Tesla V100-SXM2-32GB", links={0: bus(0x18)})
    d1 = Dev(bus(0x18), name="Tesla V100-SXM2-32GB", links={0: bus(0x17)})
    result = discover_gpus(FakeNvml([d0, d1], old_bindings=True))
    assert [g.name for g in result.gpus] == ["Tesla V100-SXM2-32GB"] * 2
    assert all(isinstance(g.uuid, str) and g.uuid.startswith("GPU-") for g in result.gpus)
    assert [g.nvlink_peers for g in result.gpus] == [(1,), (0,)]


def test_nvswitch_makes_every_gpu_a_peer_of_every_other():
    result = discover_gpus(FakeNvml(hgx_a100()))
    assert result.nvlink_known
    for g in result.gpus:
        assert g.nvlink_peers == tuple(i for i in range(8) if i != g.index)


def test_switch_peers_only_among_gpus_reaching_the_same_switch():
    # Two separate switch planes: a switch link proves nothing about GPUs on another switch.
    devs = [Dev(bus(0x10 + i), links={0: bus(0, domain=8 if i < 2 else 9)}) for i in range(4)]
    result = discover_gpus(FakeNvml(devs))
    assert [g.nvlink_peers for g in result.gpus] == [(1,), (0,), (3,), (2,)]


def test_pcie_bridges_pair_specific_cards():
    devs = [
        Dev(bus(0x01), links={0: bus(0x25), 1: bus(0x25), 2: bus(0x25), 3: bus(0x25)}),
        Dev(bus(0x25), links={0: bus(0x01), 1: bus(0x01), 2: bus(0x01), 3: bus(0x01)}),
        Dev(bus(0x41), links={0: bus(0x61), 1: bus(0x61)}),
        Dev(bus(0x61), links={0: bus(0x41), 1: bus(0x41)}),
    ]
    result = discover_gpus(FakeNvml(devs))
    assert [g.nvlink_peers for g in result.gpus] == [(1,), (0,), (3,), (2,)]
    assert result.nvlink_known


def test_not_supported_links_mean_no_nvlink_and_known_topology():
    devs = [Dev(bus(0x01), other_links=pynvml.NVML_ERROR_NOT_SUPPORTED),
            Dev(bus(0x02), other_links=pynvml.NVML_ERROR_NOT_SUPPORTED)]
    result = discover_gpus(FakeNvml(devs))
    assert [g.nvlink_peers for g in result.gpus] == [(), ()]
    assert result.nvlink_known is True


def test_function_not_found_means_no_nvlink_and_unknown_topology(caplog):
    caplog.set_level(logging.WARNING)
    devs = [Dev(bus(0x01), other_links=pynvml.NVML_ERROR_FUNCTION_NOT_FOUND),
            Dev(bus(0x02), other_links=pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)]
    fake = FakeNvml(devs)
    result = discover_gpus(fake)
    assert [g.nvlink_peers for g in result.gpus] == [(), ()]
    assert result.nvlink_known is False
    # One probe per GPU, not one per link.
    assert fake.calls.count("nvmlDeviceGetNvLinkState") == 2
    assert any("NVLink topology unknown" in m for m in warnings_of(caplog))


def test_other_link_error_keeps_readable_links_but_marks_topology_unknown():
    d0 = Dev(bus(0x17), links={0: bus(0x65), 1: pynvml.NVML_ERROR_UNKNOWN})
    d1 = Dev(bus(0x65), links={0: bus(0x17)})
    result = discover_gpus(FakeNvml([d0, d1]))
    assert [g.nvlink_peers for g in result.gpus] == [(1,), (0,)]
    assert result.nvlink_known is False


def test_link_seen_from_one_end_joins_both():
    d0 = Dev(bus(0x17), links={0: bus(0x65)})
    d1 = Dev(bus(0x65), other_links=pynvml.NVML_ERROR_NOT_SUPPORTED)
    result = discover_gpus(FakeNvml([d0, d1]))
    assert [g.nvlink_peers for g in result.gpus] == [(1,), (0,)]


def test_gpu_nvml_cannot_describe_is_left_out_without_inventing_peers(caplog):
    # A ring 0-1-2: GPU 1 is lost after its PCI id was read.  GPUs 0 and 2
    # both reach its bus id; that must not look like a shared switch.
    d0 = Dev(bus(0x10), links={0: bus(0x20)})
    d1 = Dev(bus(0x20), links={0: bus(0x10), 1: bus(0x30)}, fail={"nvmlDeviceGetUUID": pynvml.NVML_ERROR_GPU_IS_LOST})
    d2 = Dev(bus(0x30), links={0: bus(0x20)})
    caplog.set_level(logging.WARNING)
    result = discover_gpus(FakeNvml([d0, d1, d2]))
    assert [g.index for g in result.gpus] == [0, 2]
    assert [g.nvlink_peers for g in result.gpus] == [(), ()]
    assert result.nvlink_known is False
    assert any("GPU 1: left out" in m and "GPU is lost" in m for m in warnings_of(caplog))


def test_every_gpu_unusable_gives_a_reason():
    devs = [Dev(bus(0x10), fail={"nvmlDeviceGetHandleByIndex": pynvml.NVML_ERROR_NO_PERMISSION})]
    fake = FakeNvml(devs)
    result = discover_gpus(fake)
    assert result.gpus == ()
    assert "GPU 0: Insufficient Permissions" in result.reason
    assert fake.shutdowns == 1


def test_unparseable_remote_id_marks_topology_unknown():
    d0 = Dev(bus(0x17), links={0: "garbage"})
    d1 = Dev(bus(0x65), other_links=pynvml.NVML_ERROR_NOT_SUPPORTED)
    result = discover_gpus(FakeNvml([d0, d1]))
    assert [g.nvlink_peers for g in result.gpus] == [(), ()]
    assert result.nvlink_known is False


# --- pure parts -------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("00000000:1B:00.0", "00000000:1B:00.0"),
        ("0000:1b:00.0", "00000000:1B:00.0"),
        (b"00000008:00:00.0\x00\x00", "00000008:00:00.0"),
        ("1b:00.0", "00000000:1B:00.0"),
        ("", None),
        ("not a bus id", None),
        (None, None),
    ],
)
def test_normalize_bus_id(raw, expected):
    assert normalize_bus_id(raw) == expected


def test_nvlink_peers_pure():
    reports = [
        LinkReport(0, "A", ("B", "S")),
        LinkReport(1, "B", ("A",)),
        LinkReport(2, "C", ("S", "C")),  # a self-link is not a peer
    ]
    peers, known = nvlink_peers(reports)
    assert peers == {0: (1, 2), 1: (0,), 2: (0,)}
    assert known
