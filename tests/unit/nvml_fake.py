"""An NVML stand-in with the bindings' shape (no tests here): devices, their PCI buses, and an
HGX A100 board, for the discovery tests that do not have a driver."""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml


ENABLED = pynvml.NVML_FEATURE_ENABLED


DISABLED = pynvml.NVML_FEATURE_DISABLED


@dataclass
class Dev:
    bus_id: str
    name: str = "NVIDIA H100 80GB HBM3"
    memory: int = 85520809984
    # link -> remote bus id (enabled), None (disabled) or an NVML error code
    links: dict[int, str | int | None] = field(default_factory=dict)
    # links not listed: what NVML answers (devices have fewer than MAX_LINKS)
    other_links: int | None = pynvml.NVML_ERROR_INVALID_ARGUMENT
    # function name -> error code, for a device NVML cannot fully describe
    fail: dict[str, int] = field(default_factory=dict)
    uuid: str = ""
    numa: int = 0  # nvmlDeviceGetMemoryAffinity at node scope (-1: NOT_SUPPORTED)
    cpus: tuple[int, ...] = (0xFFFF,)  # nvmlDeviceGetCpuAffinity words, lowest CPUs first


class Handle:
    def __init__(self, index: int):
        self.index = index


class FakeNvml:
    """Module-shaped stand-in for ``pynvml`` over a described machine."""

    def __init__(self, devices: list[Dev], *, init_error: int | BaseException | None = None,
                 old_bindings: bool = False, count_error: int | None = None,
                 levels: dict[tuple[int, int], int] | None = None,
                 default_level: int = pynvml.NVML_TOPOLOGY_HOSTBRIDGE):
        self.devices = devices
        # (i, j) -> NVML_TOPOLOGY_* level or, when an error code is wanted, -code
        self.levels = levels or {}
        self.default_level = default_level
        for i, d in enumerate(devices):
            d.uuid = d.uuid or f"GPU-{i:08x}-1111-2222-3333-444455556666"
        self.init_error = init_error
        self.count_error = count_error
        self.old_bindings = old_bindings  # str results as bytes, as pynvml < 11.5 returned
        self.initialised = 0
        self.inits = 0
        self.shutdowns = 0
        self.calls: list[str] = []

    # Everything else a caller may look up (constants, NVMLError and its
    # subclasses) is the real module's.
    def __getattr__(self, name: str) -> Any:
        if name.startswith(("NVML_", "NVMLError")):
            return getattr(pynvml, name)
        raise AttributeError(name)

    def _check(self) -> None:
        if not self.initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def _dev(self, handle: Handle, fn: str) -> Dev:
        self._check()
        self.calls.append(fn)
        d = self.devices[handle.index]
        if fn in d.fail:
            raise pynvml.NVMLError(d.fail[fn])
        return d

    def _s(self, value: str) -> str | bytes:
        return value.encode() if self.old_bindings else value

    def _pci(self, bus_id: str) -> Any:
        if self.old_bindings:
            return SimpleNamespace(busId=bus_id.encode())
        info = pynvml.nvmlPciInfo_t()
        info.busId = bus_id.encode()
        return info

    def nvmlInit(self) -> None:
        self.inits += 1
        if isinstance(self.init_error, BaseException):
            raise self.init_error
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self._check()
        self.initialised -= 1
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        if self.count_error is not None:
            raise pynvml.NVMLError(self.count_error)
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle:
        self._check()
        if not 0 <= index < len(self.devices):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        d = self.devices[index]
        if "nvmlDeviceGetHandleByIndex" in d.fail:
            raise pynvml.NVMLError(d.fail["nvmlDeviceGetHandleByIndex"])
        return Handle(index)

    def nvmlDeviceGetUUID(self, handle: Handle) -> str | bytes:
        return self._s(self._dev(handle, "nvmlDeviceGetUUID").uuid)

    def nvmlDeviceGetName(self, handle: Handle) -> str | bytes:
        return self._s(self._dev(handle, "nvmlDeviceGetName").name)

    def nvmlDeviceGetMemoryInfo(self, handle: Handle, version: int | None = None) -> Any:
        d = self._dev(handle, "nvmlDeviceGetMemoryInfo")
        mem = pynvml.c_nvmlMemory_t()
        mem.total, mem.free, mem.used = d.memory, d.memory - 512 * 2**20, 512 * 2**20
        return mem

    def nvmlDeviceGetPciInfo(self, handle: Handle) -> Any:
        return self._pci(self._dev(handle, "nvmlDeviceGetPciInfo").bus_id)

    def _link(self, handle: Handle, link: int, fn: str) -> str | None:
        d = self._dev(handle, fn)
        if not 0 <= link < pynvml.NVML_NVLINK_MAX_LINKS:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        value = d.links[link] if link in d.links else d.other_links
        if value is None:
            return None
        if isinstance(value, int):
            raise pynvml.NVMLError(value)
        return value

    def nvmlDeviceGetTopologyCommonAncestor(self, device1: Handle, device2: Handle) -> int:
        self._dev(device1, "nvmlDeviceGetTopologyCommonAncestor")
        self._dev(device2, "nvmlDeviceGetTopologyCommonAncestor")
        a, b = sorted((device1.index, device2.index))
        level = self.levels.get((a, b), self.default_level)
        if level < 0:
            raise pynvml.NVMLError(-level)
        return level

    def nvmlDeviceGetMemoryAffinity(self, handle: Handle, nodeSetSize: int, scope: int) -> Any:
        d = self._dev(handle, "nvmlDeviceGetMemoryAffinity")
        if scope != pynvml.NVML_AFFINITY_SCOPE_NODE or d.numa < 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        words = (ctypes.c_ulonglong * nodeSetSize)()
        words[d.numa // 64] = 1 << (d.numa % 64)
        return words

    def nvmlDeviceGetCpuAffinity(self, handle: Handle, cpuSetSize: int) -> Any:
        d = self._dev(handle, "nvmlDeviceGetCpuAffinity")
        words = (ctypes.c_ulonglong * cpuSetSize)()
        for i, w in enumerate(d.cpus[:cpuSetSize]):
            words[i] = w
        return words

    def nvmlDeviceGetNvLinkState(self, handle: Handle, link: int) -> int:
        return DISABLED if self._link(handle, link, "nvmlDeviceGetNvLinkState") is None else ENABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: Handle, link: int) -> Any:
        remote = self._link(handle, link, "nvmlDeviceGetNvLinkRemotePciInfo")
        if remote is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._pci(remote)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "llmgw.hardware.nvml" and r.levelno == logging.WARNING]


def bus(n: int, domain: int = 0) -> str:
    return f"{domain:08X}:{n:02X}:00.0"


def hgx_a100(n_gpus: int = 8) -> list[Dev]:
    """Every GPU has 12 links, two to each of six NVSwitches (domains 8..13)."""
    devs = []
    for i in range(n_gpus):
        links = {link: bus(0, domain=8 + link // 2) for link in range(12)}
        devs.append(Dev(bus(0x07 + 0x10 * i), name="NVIDIA A100-SXM4-80GB", links=links))
    return devs
