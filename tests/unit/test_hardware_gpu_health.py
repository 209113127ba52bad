"""GPU health through NVML, against a stand-in for the ``pynvml`` module, and its judgement.

The stand-in has the bindings' function names and signatures, the real
``pynvml`` constants, raises ``pynvml.NVMLError(code)`` (mapped by the
bindings to their subclasses) and answers the event wait with the fields
of ``c_nvmlEventData_t``, or NVML_ERROR_TIMEOUT when nothing waits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest

from llmgw.agent.sickgpus import SickGPUs
from llmgw.hardware.gpu_health import GPUHealth, NvmlHealth, XidLatch, sick_reasons
from llmgw.hardware.types import GPU, HardwareInventory

XID = pynvml.nvmlEventTypeXidCriticalError
DBE = pynvml.nvmlEventTypeDoubleBitEccError


@dataclass
class Dev:
    ecc: int | None = 0  # None: NOT_SUPPORTED
    rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)  # None: NOT_SUPPORTED (pre-Ampere)
    pages_pending: int = pynvml.NVML_FEATURE_DISABLED
    events: int = XID | DBE  # nvmlDeviceGetSupportedEventTypes
    fail: dict[str, int] = field(default_factory=dict)  # function name -> NVML error code


class Handle:
    def __init__(self, index: int):
        self.index = index


class FakeNvml:
    def __init__(self, devices: list[Dev], *, with_v2: bool = True):
        self.devices = devices
        self.queue: list[tuple[int, int, int]] = []  # (device index, event type, data)
        self.registered: dict[int, int] = {}
        self.initialised = 0
        self.calls: list[str] = []
        if not with_v2:
            self.nvmlEventSetWait_v2 = None  # older bindings: only nvmlEventSetWait

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("NVML_", "NVMLError", "nvmlEventType")):
            return getattr(pynvml, name)
        raise AttributeError(name)

    def _dev(self, name: str, handle: Handle) -> Dev:
        if not self.initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        self.calls.append(name)
        d = self.devices[handle.index]
        if name in d.fail:
            raise pynvml.NVMLError(d.fail[name])
        return d

    def nvmlInit(self) -> None:
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Handle:
        self._dev("nvmlDeviceGetHandleByIndex", Handle(i))
        return Handle(i)

    def nvmlDeviceGetIndex(self, h: Handle) -> int:
        return h.index

    def nvmlDeviceGetTotalEccErrors(self, h: Handle, error_type: int, counter_type: int) -> int:
        d = self._dev("nvmlDeviceGetTotalEccErrors", h)
        assert (error_type, counter_type) == (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        if d.ecc is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return d.ecc

    def nvmlDeviceGetRemappedRows(self, h: Handle) -> tuple[int, int, int, int]:
        d = self._dev("nvmlDeviceGetRemappedRows", h)
        if d.rows is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return d.rows

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: Handle) -> int:
        return self._dev("nvmlDeviceGetRetiredPagesPendingStatus", h).pages_pending

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlEventSetFree(self, s: str) -> None:
        pass

    def nvmlDeviceGetSupportedEventTypes(self, h: Handle) -> int:
        return self._dev("nvmlDeviceGetSupportedEventTypes", h).events

    def nvmlDeviceRegisterEvents(self, h: Handle, types: int, s: str) -> None:
        self._dev("nvmlDeviceRegisterEvents", h)
        assert s == "event-set"
        self.registered[h.index] = types

    def nvmlEventSetWait_v2(self, s: str, timeout_ms: int) -> "_Event":
        assert timeout_ms == 0, "a drain never blocks rediscovery"
        while self.queue:
            index, etype, data = self.queue.pop(0)
            if self.registered.get(index, 0) & etype:
                return _Event(Handle(index), etype, data)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetWait(self, s: str, timeout_ms: int) -> Any:
        return FakeNvml.nvmlEventSetWait_v2(self, s, timeout_ms)


@dataclass
class _Event:
    """``c_nvmlEventData_t``'s fields; ``device`` a handle the stand-in can index."""

    device: Handle
    eventType: int
    eventData: int


def test_healthy_gpus_are_fit_and_nvml_stays_initialised_for_the_event_set():
    nvml = FakeNvml([Dev(), Dev()])
    h = NvmlHealth(nvml)
    out = h.read()
    assert set(out) == {0, 1}
    assert all(sick_reasons(x) == [] for x in out.values())
    assert out[0] == GPUHealth(ecc_uncorrected_volatile=0, remapped_rows_pending=False, remapped_rows_failure=False)
    assert nvml.registered == {0: XID | DBE, 1: XID | DBE}
    assert "nvmlDeviceGetRetiredPagesPendingStatus" not in nvml.calls, "row remapping answered: pages not asked"
    assert nvml.initialised == 1
    h.read()
    assert nvml.initialised == 1 and nvml.calls.count("nvmlDeviceRegisterEvents") == 2, "registered once per GPU"
    h.close()
    assert nvml.initialised == 0


@pytest.mark.parametrize("with_v2", [True, False])
def test_an_xid_that_needs_a_reset_makes_its_gpu_sick_and_an_application_xid_does_not(with_v2):
    nvml = FakeNvml([Dev(), Dev(), Dev()], with_v2=with_v2)
    h = NvmlHealth(nvml)
    h.read()
    nvml.queue += [(1, XID, 79), (2, XID, 13), (0, DBE, 0)]
    out = h.read()
    assert out[1].xids == (79,) and sick_reasons(out[1]) == ["Xid 79 (GPU has fallen off the bus)"]
    assert out[2].xids == (13,) and sick_reasons(out[2]) == []
    assert out[0].xids == (48,) and sick_reasons(out[0]) == ["Xid 48 (double-bit ECC error)"]


def test_readings_ecc_remap_pending_and_failure():
    nvml = FakeNvml([Dev(ecc=3), Dev(rows=(0, 1, 1, 0)), Dev(rows=(0, 0, 0, 1)), Dev()])
    out = NvmlHealth(nvml).read()
    assert sick_reasons(out[0]) == ["3 uncorrected ECC error(s) since the last reset"]
    assert sick_reasons(out[1]) == ["row remapping pending (takes effect at the next GPU reset)"]
    assert sick_reasons(out[2]) == ["row remapping failed"]
    assert sick_reasons(out[3]) == []


def test_older_boards_are_asked_for_retired_pages_instead_of_row_remapping():
    nvml = FakeNvml([Dev(rows=None, pages_pending=pynvml.NVML_FEATURE_ENABLED), Dev(rows=None)])
    out = NvmlHealth(nvml).read()
    assert out[0].retired_pages_pending is True and out[0].remapped_rows_pending is None
    assert sick_reasons(out[0]) == ["retired pages pending (take effect at the next GPU reset)"]
    assert out[1].retired_pages_pending is False and sick_reasons(out[1]) == []
    assert any(n.startswith("row remapping: nvmlDeviceGetRemappedRows: Not Supported") for n in out[1].not_checked)


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND])
def test_a_check_nvml_cannot_answer_is_not_checked_never_sick_and_said_once(code, caplog):
    fail = {n: code for n in ("nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows",
                              "nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceRegisterEvents")}
    nvml = FakeNvml([Dev(fail=fail)])
    h = NvmlHealth(nvml)
    with caplog.at_level(logging.INFO, logger="llmgw.hardware.gpu_health"):
        first = h.read()[0]
        again = h.read()[0]
    assert sick_reasons(first) == [] and first == again
    assert [n.split(":", 1)[0] for n in first.not_checked] == [
        "uncorrected ECC errors", "row remapping", "retired pages", "Xid events"]
    assert first.ecc_uncorrected_volatile is None and first.retired_pages_pending is None
    said = [r for r in caplog.records if "not checked" in r.getMessage()]
    assert len(said) == 4 and all(r.levelno == logging.INFO for r in said), "each said once, at INFO"


def test_a_device_without_xid_events_says_so():
    nvml = FakeNvml([Dev(events=DBE)])
    (only,) = NvmlHealth(nvml).read().values()
    assert "Xid events: the device does not support Xid critical-error events" in only.not_checked
    assert nvml.registered == {}


@pytest.mark.parametrize("where", ["nvmlDeviceGetHandleByIndex", "nvmlDeviceGetSupportedEventTypes",
                                   "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows"])
def test_gpu_is_lost_from_any_per_device_call_makes_it_lost(where):
    nvml = FakeNvml([Dev(), Dev(fail={where: pynvml.NVML_ERROR_GPU_IS_LOST})])
    out = NvmlHealth(nvml).read()
    assert out[1] == GPUHealth(lost=True) and sick_reasons(out[1])[0].startswith("lost")
    assert sick_reasons(out[0]) == []


def test_another_error_is_not_checked_with_nvmls_words_at_warning(caplog):
    nvml = FakeNvml([Dev(fail={"nvmlDeviceGetTotalEccErrors": pynvml.NVML_ERROR_UNKNOWN})])
    with caplog.at_level(logging.INFO, logger="llmgw.hardware.gpu_health"):
        (only,) = NvmlHealth(nvml).read().values()
    assert only.not_checked == ("uncorrected ECC errors: nvmlDeviceGetTotalEccErrors: Unknown Error",)
    assert [r.levelno for r in caplog.records if "not checked" in r.getMessage()] == [logging.WARNING]


def test_without_nvml_nothing_is_read():
    class NoDriver(FakeNvml):
        def nvmlInit(self) -> None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    assert NvmlHealth(NoDriver([Dev()])).read() == {}


def test_an_xid_is_latched_until_the_agent_restarts():
    latch = XidLatch()
    assert latch.latch({0: GPUHealth(xids=(79,))})[0].xids == (79,)
    assert latch.latch({0: GPUHealth(ecc_uncorrected_volatile=0)})[0].xids == (79,)
    assert latch.latch({})[0].xids == (79,), "a GPU not read this time keeps its events"


def gpus(n: int) -> HardwareInventory:
    return HardwareInventory(node_id="a", gpu_source="simulated", gpus=tuple(
        GPU(i, f"GPU-{i}", "Sim", 1 << 30, f"00000000:{i + 1:02x}:00.0", nvlink_peers=tuple(j for j in range(n) if j != i))
        for i in range(n)))


def test_sick_gpus_are_withheld_with_reason_and_since_and_come_back_when_the_condition_clears():
    t = [1_800_000_000.0]
    sick = SickGPUs(clock=lambda: t[0])
    inv = gpus(3)
    shown = sick.apply(inv, {1: GPUHealth(ecc_uncorrected_volatile=2), 2: GPUHealth(lost=True)})
    assert [g.index for g in shown.gpus] == [0]
    assert shown.gpus[0].nvlink_peers == (), "peers pointing at a withheld GPU are dropped"
    assert [(s.index, s.since) for s in shown.sick_gpus] == [(1, t[0]), (2, t[0])]
    assert shown.gpu_reason == ("GPU 1 withheld: 2 uncorrected ECC error(s) since the last reset at "
                                "2027-01-15T08:00:00Z; GPU 2 withheld: lost (NVML: GPU is lost, it has fallen off "
                                "the bus or stopped answering) at 2027-01-15T08:00:00Z")
    t[0] += 60
    again = sick.apply(inv, {1: GPUHealth(ecc_uncorrected_volatile=2), 2: GPUHealth(lost=True)})
    assert again.to_dict() == shown.to_dict(), "an unchanged state is the same document: nothing is resent"
    back = sick.apply(inv, {1: GPUHealth(ecc_uncorrected_volatile=0)})
    assert [g.index for g in back.gpus] == [0, 1, 2] and back.sick_gpus == () and back.gpu_reason is None
    assert back.gpus[1].health == GPUHealth(ecc_uncorrected_volatile=0)


def test_a_sick_gpu_discovery_left_out_is_still_listed():
    shown = SickGPUs(clock=lambda: 0.0).apply(gpus(1), {3: GPUHealth(lost=True)})
    assert [g.index for g in shown.gpus] == [0] and [s.index for s in shown.sick_gpus] == [3]
    assert HardwareInventory.from_dict(shown.to_dict()) == shown
