"""Run llmgw's GPU discovery against a real NVML and keep everything it saw.

Run on a machine with an NVIDIA driver (no network needed; Python with the
package's runtime dependencies, or ``PYTHONPATH`` pointing at them)::

    python3 tests/device/capture_nvml.py --out DIR

It writes into DIR:

* ``nvml-recording.json``: every NVML call discovery made, and the health
  queries an agent may make (ECC counters, row remapping, retired pages,
  event registration and waiting, MIG mode), with results or error codes;
* ``discovery.json``: the node's inventory as discovery found it;
* ``health.json``: each GPU's health as the agent's reader judged it, read
  before and after a discovery (which opens and closes NVML itself) while the
  reader keeps its session and event set, as the agent does;
* ``nvidia-smi-topo.txt``, ``nvidia-smi-q.xml``: the driver's own tools on
  the same machine, to compare against;
* ``sysfs.json``: each GPU's PCI path, NUMA node and local CPUs from sysfs,
  the NUMA nodes, the InfiniBand class directory, the driver version;
* ``capture.log``: discovery's own log lines.

``tests/unit/test_hardware_nvml_recorded.py`` replays the recording and
checks discovery against the driver's tools.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent.parent / "agent")]

from nvml_recording import RecordingNvml  # noqa: E402


def _quietly(m: RecordingNvml, name: str, *args: Any) -> Any:
    """Make one recorded call; its error is in the recording, so carry on.
    A function these bindings lack is skipped (the recording lists theirs)."""
    try:
        fn = getattr(m, name)
    except AttributeError:
        return None
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - every outcome is recorded
        return None


def health_queries(rec: RecordingNvml) -> None:
    """The per-GPU health and identity queries an agent may rely on."""
    m = rec
    _quietly(m, "nvmlInit")
    try:
        for fn in ("nvmlSystemGetDriverVersion", "nvmlSystemGetNVMLVersion", "nvmlSystemGetCudaDriverVersion",
                   "nvmlSystemGetCudaDriverVersion_v2"):
            _quietly(m, fn)
        count = _quietly(m, "nvmlDeviceGetCount") or 0
        _quietly(m, "nvmlDeviceGetHandleByIndex", count)  # one past the end: the driver's own error
        for index in range(count):
            h = _quietly(m, "nvmlDeviceGetHandleByIndex", index)
            if h is None:
                continue
            pci = _quietly(m, "nvmlDeviceGetPciInfo", h)
            uuid = _quietly(m, "nvmlDeviceGetUUID", h)
            if pci is not None:
                _quietly(m, "nvmlDeviceGetHandleByPciBusId", pci.busId)
            if uuid is not None:
                _quietly(m, "nvmlDeviceGetHandleByUUID", uuid)
            for err in ("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_MEMORY_ERROR_TYPE_CORRECTED"):
                for counter in ("NVML_VOLATILE_ECC", "NVML_AGGREGATE_ECC"):
                    _quietly(m, "nvmlDeviceGetTotalEccErrors", h, getattr(m, err), getattr(m, counter))
            for fn in ("nvmlDeviceGetEccMode", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetRowRemapperHistogram",
                       "nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceGetMigMode", "nvmlDeviceGetPersistenceMode",
                       "nvmlDeviceGetComputeMode", "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetArchitecture",
                       "nvmlDeviceGetSupportedEventTypes", "nvmlDeviceGetCurrPcieLinkGeneration",
                       "nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetMaxPcieLinkGeneration",
                       "nvmlDeviceGetMaxPcieLinkWidth", "nvmlDeviceGetCurrentClocksEventReasons",
                       "nvmlDeviceGetPowerUsage", "nvmlDeviceGetSerial", "nvmlDeviceGetBoardPartNumber",
                       "nvmlDeviceGetVbiosVersion", "nvmlDeviceGetMinorNumber", "nvmlDeviceGetGpuFabricInfoV",
                       "nvmlDeviceGetGpuFabricInfo", "nvmlDeviceGetNumaNodeId", "nvmlDeviceGetBoardId",
                       "nvmlDeviceGetMultiGpuBoard", "nvmlDeviceGetBrand"):
                _quietly(m, fn, h)
            for scope in ("NVML_AFFINITY_SCOPE_NODE", "NVML_AFFINITY_SCOPE_SOCKET"):
                _quietly(m, "nvmlDeviceGetMemoryAffinity", h, 1, getattr(m, scope))
                _quietly(m, "nvmlDeviceGetCpuAffinityWithinScope", h, 1, getattr(m, scope))
            _quietly(m, "nvmlDeviceGetTemperature", h, m.NVML_TEMPERATURE_GPU)
            _quietly(m, "nvmlDeviceGetTopologyCommonAncestor", h, h)
            for cause in ("NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR",
                          "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS"):
                _quietly(m, "nvmlDeviceGetRetiredPages", h, getattr(m, cause))
            # Events: what an agent registers for, and what waiting answers with none pending.
            wanted = (m.nvmlEventTypeXidCriticalError | m.nvmlEventTypeDoubleBitEccError
                      | m.nvmlEventTypeSingleBitEccError)
            for types in (wanted, m.nvmlEventTypeXidCriticalError):
                es = _quietly(m, "nvmlEventSetCreate")
                if es is None:
                    break
                _quietly(m, "nvmlDeviceRegisterEvents", h, types, es)
                _quietly(m, "nvmlEventSetWait_v2", es, 0)
                _quietly(m, "nvmlEventSetWait_v2", es, 200)
                _quietly(m, "nvmlEventSetFree", es)
    finally:
        _quietly(m, "nvmlShutdown")
    _quietly(m, "nvmlDeviceGetCount")  # after shutdown: UNINITIALIZED, as the driver says it


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError as e:
        return f"<{type(e).__name__}: {e.strerror or e}>"


def sysfs_facts(bus_ids: list[str]) -> dict[str, Any]:
    facts: dict[str, Any] = {"gpus": {}, "numa_nodes": {}, "infiniband": None,
                             "cpu_count": os.cpu_count(), "uname": platform.uname()._asdict(),
                             "driver": _read(Path("/proc/driver/nvidia/version"))}
    for bus in bus_ids:
        domain, rest = bus.split(":", 1)
        dev = Path("/sys/bus/pci/devices") / f"{int(domain, 16):04x}:{rest.lower()}"
        entry: dict[str, Any] = {"sysfs": str(dev)}
        try:
            entry["resolved"] = str(dev.resolve(strict=True))
        except OSError as e:
            entry["resolved"] = f"<{type(e).__name__}: {e}>"
        for name in ("numa_node", "local_cpulist", "current_link_speed", "current_link_width",
                     "max_link_speed", "max_link_width", "vendor", "device", "class"):
            entry[name] = _read(dev / name)
        facts["gpus"][bus] = entry
    nodes = Path("/sys/devices/system/node")
    if nodes.is_dir():
        for node in sorted(nodes.glob("node[0-9]*")):
            facts["numa_nodes"][node.name] = _read(node / "cpulist")
    ib = Path("/sys/class/infiniband")
    facts["infiniband"] = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else f"<{ib} absent>"
    return facts


def _run(out: Path, name: str, argv: list[str]) -> None:
    """The tool's output as it printed it; its errors and exit status go to the log."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        logging.warning("%s: %s", " ".join(argv), e)
        return
    (out / name).write_text(done.stdout)
    logging.info("%s: exit %d%s", " ".join(argv), done.returncode, f"; stderr: {done.stderr}" if done.stderr else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(filename=out / "capture.log", level=logging.DEBUG,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import pynvml

    from llmgw.hardware.discover import discover

    from llmgw.hardware.gpu_health import NvmlHealth

    rec = RecordingNvml(pynvml)
    health = NvmlHealth(rec)
    before = health.read()
    started = time.monotonic()
    inventory = discover(platform.node() or "gpu-node", gpu_source="nvml", nvml=rec)
    took = time.monotonic() - started
    after = health.read()
    health.close()
    discovery = inventory.to_dict()
    (out / "discovery.json").write_text(json.dumps(discovery, indent=2, sort_keys=True) + "\n")
    (out / "health.json").write_text(json.dumps(
        {"before_discovery": {str(i): h.to_dict() for i, h in before.items()},
         "after_discovery": {str(i): h.to_dict() for i, h in after.items()}}, indent=2, sort_keys=True) + "\n")
    health_queries(rec)

    try:
        from importlib.metadata import version
        bindings = version("nvidia-ml-py")
    except Exception as e:  # noqa: BLE001
        bindings = f"unknown ({e})"
    doc = rec.document(bindings="nvidia-ml-py " + bindings, python=sys.version.split()[0],
                       discovery_seconds=round(took, 3), os_cpu_count=os.cpu_count(),
                       recorded_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    (out / "nvml-recording.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")

    _run(out, "nvidia-smi-topo.txt", ["nvidia-smi", "topo", "-m"])
    _run(out, "nvidia-smi-q.xml", ["nvidia-smi", "-q", "-x"])
    bus_ids = [g["pci_bus_id"] for g in discovery.get("gpus", [])]
    (out / "sysfs.json").write_text(json.dumps(sysfs_facts(bus_ids), indent=2, sort_keys=True) + "\n")
    print(json.dumps({"gpus": len(bus_ids), "gpu_reason": discovery.get("gpu_reason"),
                      "calls": len(rec.calls), "discovery_seconds": round(took, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
