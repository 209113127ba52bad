"""Which processes hold each GPU, as NVML lists them, and the same field in a hardware file.

NVML is faked at the C boundary underneath the real bindings: the process
queries called are ``pynvml``'s own wrappers (``nvmlDeviceGet{Compute,
Graphics}RunningProcesses`` and their ``_v3``/``_v2`` versions), and only
``pynvml._nvmlGetFunctionPointer`` is replaced, by a function that plays the
driver's C entry point: the size query answering NVML_ERROR_INSUFFICIENT_SIZE,
then ``c_nvmlProcessInfo_t`` structures filled in, with
NVML_VALUE_NOT_AVAILABLE (2**64 - 1) for memory NVML cannot account.  So the
values reaching discovery are exactly what the bindings return (friendly
objects, ``usedGpuMemory`` None for that sentinel), including their errors
(``NVMLError`` subclasses, ``NVMLLibraryMismatchError`` from the unversioned
wrapper when the driver lacks the newest symbol).  Everything else NVML
answers comes from ``FakeNvml`` of test_hardware_nvml.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pynvml
import pytest
import yaml

from llmgw.config import ConfigInvalid, schema_errors
from llmgw.hardware import nvml as nvml_mod
from llmgw.hardware.discover import discover
from llmgw.hardware.nvml import discover_gpus
from llmgw.hardware.simulated import load_hardware_file
from llmgw.hardware.types import GPU, GPUProcess, HardwareInventory
from nvml_fake import Dev, FakeNvml, bus, warnings_of

NOT_AVAILABLE = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
GIB = 1 << 30
QUERIES = ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses")
VERSIONS = ("_v3", "_v2", "")


class ProcNvml(FakeNvml):
    """``FakeNvml`` plus the process queries, through the real bindings' wrappers.

    ``compute``/``graphics``: per GPU index, (pid, used bytes or None) as the
    driver would fill them in.  ``driver``: the C symbols the driver has.
    ``bindings``: the wrapper names the bindings module exposes (older
    ``pynvml`` releases had no ``_v3``).  ``c_errors``: C symbol -> NVML
    return code, for a query that fails.
    """

    NVMLLibraryMismatchError = pynvml.NVMLLibraryMismatchError

    def __init__(self, devices: list[Dev], *, compute: dict[int, list[tuple[int, int | None]]] | None = None,
                 graphics: dict[int, list[tuple[int, int | None]]] | None = None,
                 driver: set[str] | None = None, bindings: set[str] | None = None,
                 c_errors: dict[str, int] | None = None, **kw: Any):
        super().__init__(devices, **kw)
        self.compute = compute or {}
        self.graphics = graphics or {}
        self.driver = driver if driver is not None else {q + v for q in QUERIES for v in ("_v3", "_v2")}
        self.bindings = bindings if bindings is not None else {q + v for q in QUERIES for v in VERSIONS}
        self.c_errors = c_errors or {}
        self.c_calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name in self.__dict__.get("bindings", ()):
            return getattr(pynvml, name)  # the real wrapper, which asks _nvmlGetFunctionPointer below
        return super().__getattr__(name)

    def function_pointer(self, name: str):
        """What ``pynvml._nvmlGetFunctionPointer`` returns: the driver's C function, or FUNCTION_NOT_FOUND."""
        if not self.initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if name not in self.driver:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        table = self.compute if "Compute" in name else self.graphics

        def c_function(handle, count_ref, procs) -> int:
            self.c_calls.append(name)
            if name in self.c_errors:
                return self.c_errors[name]
            count = count_ref._obj
            entries = table.get(handle.index, [])
            if procs is None or count.value < len(entries):
                count.value = len(entries)
                return pynvml.NVML_SUCCESS if not entries else pynvml.NVML_ERROR_INSUFFICIENT_SIZE
            for i, (pid, used) in enumerate(entries):
                procs[i].pid = pid
                procs[i].usedGpuMemory = NOT_AVAILABLE if used is None else used
                procs[i].gpuInstanceId = 0xFFFFFFFF  # not a MIG instance
                procs[i].computeInstanceId = 0xFFFFFFFF
            count.value = len(entries)
            return pynvml.NVML_SUCCESS

        return c_function


@pytest.fixture
def driver(monkeypatch):
    """Installs a ProcNvml as the driver under the real bindings' process wrappers."""
    def install(fake: ProcNvml) -> ProcNvml:
        monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", fake.function_pointer)
        return fake
    return install


@pytest.fixture(autouse=True)
def _fresh_warnings():
    nvml_mod._reset_warnings()
    yield
    nvml_mod._reset_warnings()


def two_gpus() -> list[Dev]:
    return [Dev(bus(0x17), links={0: bus(0x65)}), Dev(bus(0x65), links={0: bus(0x17)})]


def pids(gpu: GPU) -> list[tuple[int, int | None]] | None:
    return None if gpu.processes is None else [(p.pid, p.used_memory_bytes) for p in gpu.processes]


# --- the fake is the real bindings' behaviour ---------------------------------


def test_the_real_wrapper_turns_not_available_into_none(driver):
    fake = driver(ProcNvml(two_gpus(), compute={0: [(4242, None), (77, 3 * GIB)]}))
    fake.nvmlInit()
    procs = fake.nvmlDeviceGetComputeRunningProcesses(fake.nvmlDeviceGetHandleByIndex(0))
    assert [(p.pid, p.usedGpuMemory) for p in procs] == [(4242, None), (77, 3 * GIB)]
    assert type(procs[0]).__name__ == "nvmlFriendlyObject"
    assert fake.c_calls == ["nvmlDeviceGetComputeRunningProcesses_v3"] * 2  # size query, then the data
    assert fake.nvmlDeviceGetComputeRunningProcesses(fake.nvmlDeviceGetHandleByIndex(1)) == []
    fake.nvmlShutdown()


# --- discovery ---------------------------------------------------------------


def test_each_gpu_lists_its_compute_and_graphics_processes(driver):
    fake = driver(ProcNvml(
        two_gpus(),
        compute={0: [(4242, 20 * GIB), (7, None)]},
        graphics={0: [(4242, 20 * GIB), (9000, 256 << 20)]},  # 4242 has both kinds of context: listed once
    ))
    result = discover_gpus(fake)
    g0, g1 = result.gpus
    assert pids(g0) == [(7, None), (4242, 20 * GIB), (9000, 256 << 20)]
    assert pids(g1) == []  # asked, and NVML lists nothing: not the same as unknown
    assert g0.nvlink_peers == (1,) and result.nvlink_known and result.reason is None
    assert fake.shutdowns == 1 and fake.initialised == 0
    assert g0.to_dict()["processes"] == [{"pid": 7, "used_memory_bytes": None},
                                         {"pid": 4242, "used_memory_bytes": 20 * GIB},
                                         {"pid": 9000, "used_memory_bytes": 256 << 20}]
    assert g1.to_dict()["processes"] == []


def test_memory_known_in_one_list_only_is_kept(driver):
    fake = driver(ProcNvml([Dev(bus(0x17))], compute={0: [(11, None)]}, graphics={0: [(11, 5 * GIB)]}))
    (g,) = discover_gpus(fake).gpus
    assert pids(g) == [(11, 5 * GIB)]


def test_a_driver_without_v3_is_asked_with_v2(driver):
    fake = driver(ProcNvml(two_gpus(), compute={1: [(31337, GIB)]},
                           driver={q + "_v2" for q in QUERIES}))
    g0, g1 = discover_gpus(fake).gpus
    assert pids(g0) == [] and pids(g1) == [(31337, GIB)]
    assert "nvmlDeviceGetComputeRunningProcesses_v2" in fake.c_calls
    assert not any(c.endswith("_v3") for c in fake.c_calls)


def test_older_bindings_without_v3_and_a_raw_not_available_value(driver, monkeypatch):
    # Bindings that predate _v3 and pass the driver's sentinel through unconverted.
    fake = driver(ProcNvml([Dev(bus(0x17))], bindings={q + v for q in QUERIES for v in ("_v2", "")}))

    def raw_v2(handle):
        info = pynvml.c_nvmlProcessInfo_v2_t()
        info.pid, info.usedGpuMemory = 555, NOT_AVAILABLE
        return [pynvml.nvmlStructToFriendlyObject(info)]

    fake.bindings.discard("nvmlDeviceGetComputeRunningProcesses_v2")
    fake.__dict__["nvmlDeviceGetComputeRunningProcesses_v2"] = raw_v2
    (g,) = discover_gpus(fake).gpus
    assert pids(g) == [(555, None)]


def test_a_failed_query_leaves_that_gpu_unknown_and_discovery_intact(driver, caplog):
    caplog.set_level(logging.WARNING)
    fake = driver(ProcNvml(two_gpus(), compute={1: [(8, GIB)]},
                           c_errors={"nvmlDeviceGetComputeRunningProcesses_v3": pynvml.NVML_ERROR_NO_PERMISSION}))
    result = discover_gpus(fake)
    g0, g1 = result.gpus
    assert g0.processes is None and g1.processes is None
    assert "processes" not in g0.to_dict()
    assert [g.nvlink_peers for g in result.gpus] == [(1,), (0,)] and result.reason is None
    assert fake.shutdowns == 1
    assert any("GPU 0: processes unknown" in m and "Insufficient Permissions" in m for m in warnings_of(caplog))


def test_one_gpu_failing_leaves_the_others_listed(driver):
    class OneLost(ProcNvml):
        def function_pointer(self, name):
            inner = super().function_pointer(name)
            return lambda handle, count, procs: (pynvml.NVML_ERROR_GPU_IS_LOST if handle.index == 0
                                                 else inner(handle, count, procs))
    fake = driver(OneLost(two_gpus(), compute={1: [(99, None)]}))
    g0, g1 = discover_gpus(fake).gpus
    assert g0.processes is None and pids(g1) == [(99, None)]


def test_graphics_not_supported_means_compute_only(driver):
    fake = driver(ProcNvml([Dev(bus(0x17))], compute={0: [(5, GIB)]},
                           c_errors={"nvmlDeviceGetGraphicsRunningProcesses_v3": pynvml.NVML_ERROR_NOT_SUPPORTED}))
    (g,) = discover_gpus(fake).gpus
    assert pids(g) == [(5, GIB)]


def test_graphics_failing_otherwise_means_unknown(driver, caplog):
    caplog.set_level(logging.WARNING)
    fake = driver(ProcNvml([Dev(bus(0x17))], compute={0: [(5, GIB)]},
                           c_errors={"nvmlDeviceGetGraphicsRunningProcesses_v3": pynvml.NVML_ERROR_UNKNOWN}))
    (g,) = discover_gpus(fake).gpus
    assert g.processes is None
    assert any("nvmlDeviceGetGraphicsRunningProcesses failed" in m for m in warnings_of(caplog))


def test_a_driver_with_no_process_query_at_all(driver, caplog):
    caplog.set_level(logging.WARNING)
    fake = driver(ProcNvml(two_gpus(), driver=set()))
    result = discover_gpus(fake)
    assert [g.processes for g in result.gpus] == [None, None] and len(result.gpus) == 2
    assert any("no compute process query" in m for m in warnings_of(caplog))


def test_a_driver_with_only_graphics_missing_still_lists_compute(driver):
    fake = driver(ProcNvml([Dev(bus(0x17))], compute={0: [(5, None)]},
                           driver={"nvmlDeviceGetComputeRunningProcesses_v3"}))
    (g,) = discover_gpus(fake).gpus
    assert pids(g) == [(5, None)]


def test_anything_unexpected_from_the_bindings_is_unknown_not_a_crash(driver):
    fake = driver(ProcNvml([Dev(bus(0x17))]))

    def broken(handle):
        raise OSError(5, "Input/output error")

    fake.bindings.discard("nvmlDeviceGetComputeRunningProcesses_v3")
    fake.__dict__["nvmlDeviceGetComputeRunningProcesses_v3"] = broken
    result = discover_gpus(fake)
    assert len(result.gpus) == 1 and result.gpus[0].processes is None and result.reason is None


def test_nvml_discovery_reaches_the_inventory(driver, tmp_path):
    fake = driver(ProcNvml(two_gpus(), compute={0: [(4242, GIB)]}))
    inv = discover("node-x", nvml=fake, sysfs_root=tmp_path / "none")
    assert pids(inv.gpu(0)) == [(4242, GIB)] and pids(inv.gpu(1)) == []
    assert schema_errors(inv.to_dict(), "hardware") == []
    assert HardwareInventory.from_dict(inv.to_dict()).gpus == inv.gpus


# --- the same field in a hardware file ------------------------------------------


def hardware_doc(processes: Any = None) -> dict[str, Any]:
    inv = HardwareInventory(node_id="n", gpu_source="simulated", gpus=tuple(
        GPU(i, f"GPU-n-{i}", "Simulated H100 80GB", 80 * GIB, f"00000000:{0x10 + i:02X}:00.0")
        for i in range(2)))
    doc = inv.to_dict()
    if processes is not None:
        doc["gpus"][0]["processes"] = processes
    return doc


def write(tmp_path: Path, doc: dict[str, Any]) -> Path:
    path = tmp_path / "hardware.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_hardware_file_lists_processes_as_discovery_does(tmp_path):
    path = write(tmp_path, hardware_doc([{"pid": 4242, "used_memory_bytes": 2 * GIB}, {"pid": 7},
                                         {"pid": 8, "used_memory_bytes": None}]))
    inv = load_hardware_file(path, node_id="node-x")
    assert inv.gpu(0).processes == (GPUProcess(4242, 2 * GIB), GPUProcess(7, None), GPUProcess(8, None))
    assert inv.gpu(1).processes is None  # not said: unknown
    again = discover("node-x", gpu_source="simulated", hardware_file=path, sysfs_root=tmp_path / "none")
    assert again.gpu(0).processes == inv.gpu(0).processes
    assert schema_errors(again.to_dict(), "hardware") == []


def test_an_empty_list_is_kept_apart_from_absent(tmp_path):
    inv = load_hardware_file(write(tmp_path, hardware_doc([])))
    assert inv.gpu(0).processes == () and inv.gpu(1).processes is None
    assert inv.to_dict()["gpus"][0]["processes"] == [] and "processes" not in inv.to_dict()["gpus"][1]


@pytest.mark.parametrize(("processes", "pointer"), [
    ([{"pid": 1, "memory": 5}], "/gpus/0/processes/0/memory"),  # additionalProperties false
    ([{"used_memory_bytes": 5}], "/gpus/0/processes/0"),  # pid required
    ([{"pid": -1}], "/gpus/0/processes/0/pid"),
    ([{"pid": 1, "used_memory_bytes": -5}], "/gpus/0/processes/0/used_memory_bytes"),
    ([{"pid": "4242"}], "/gpus/0/processes/0/pid"),
    ({"pid": 1}, "/gpus/0/processes"),
])
def test_the_schema_refuses_malformed_processes(processes, pointer):
    errors = schema_errors(hardware_doc(processes), "hardware")
    assert errors and all(e.pointer == pointer for e in errors), errors


def test_a_pid_listed_twice_on_one_gpu_is_an_error(tmp_path):
    path = write(tmp_path, hardware_doc([{"pid": 5}, {"pid": 6}, {"pid": 5}]))
    with pytest.raises(ConfigInvalid) as e:
        load_hardware_file(path)
    assert [(x.pointer, x.message) for x in e.value.errors] == [
        ("/gpus/0/processes/2/pid", "duplicate pid 5 (also /gpus/0/processes/0)")]
