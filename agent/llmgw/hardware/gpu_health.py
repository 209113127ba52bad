"""Whether each GPU is fit to be given out: NVML's health signals, read and judged.

A GPU can keep answering discovery (name, memory, bus id) while it is unfit
to run anything: it has fallen off the bus, its memory has an uncorrected
error, or the driver raised a critical Xid.  Placing a replica there, or
leaving one there, only turns into failed requests.  What is read, per GPU,
each time the agent rediscovers:

* **lost**: ``NVML_ERROR_GPU_IS_LOST`` from any per-device call below (the
  handle lookup included).
* **uncorrected ECC errors**: ``nvmlDeviceGetTotalEccErrors(handle,
  NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)`` > 0.  The
  volatile counter counts since the last driver load or GPU reset.
* **row remapping** (Ampere and later): ``nvmlDeviceGetRemappedRows``
  reporting a remap pending (takes effect only at the next reset) or a
  remapping failure.
* **retired pages pending** (older boards, asked only when row remapping is
  not supported): ``nvmlDeviceGetRetiredPagesPendingStatus`` enabled.
* **Xid events**: an NVML event set, registered once per GPU for
  ``nvmlEventTypeXidCriticalError | nvmlEventTypeDoubleBitEccError`` (only
  the types ``nvmlDeviceGetSupportedEventTypes`` lists), kept for the
  agent's life and drained without waiting at every read
  (``nvmlEventSetWait_v2(set, 0)``, or ``nvmlEventSetWait`` with bindings
  that lack ``_v2``).  A double-bit ECC event is recorded as Xid 48, which is
  how the driver reports it.  Only the codes in ``XID_NEEDS_RESET`` make a
  GPU sick; others (13, 31, 43: an application's fault) are logged.

What clears a sick GPU:

* lost, ECC, row remapping, retired pages: the condition itself, read again
  at each rediscovery (the volatile ECC counter and a pending remap clear
  only when the GPU is reset, so in practice a reset clears them);
* an Xid: nothing but an agent restart.  An event has no "resolved" state;
  after resetting the GPU (``nvidia-smi -r``) or rebooting, restart the
  agent (its engines are adopted, not restarted).

A check NVML answers ``NVML_ERROR_NOT_SUPPORTED`` or
``NVML_ERROR_FUNCTION_NOT_FOUND`` to is *not checked* for that GPU: never
a reason to withhold it, never guessed, listed in the GPU's ``health.not_checked``
in what the node advertises and logged once at INFO.  Any other error
makes that check not checked too, with NVML's words, logged at WARNING.

On an H200 (driver 580) these calls answer as the unit tests' stand-in does:
row remapping answers and retired pages are NOT_SUPPORTED, Xid and
double-bit ECC events are supported, an empty drain answers
NVML_ERROR_TIMEOUT at once, and the event set outlives another session's
``nvmlInit``/``nvmlShutdown``.

Everything NVML is reached through the ``nvml`` argument (the ``pynvml``
module by default), and only documented pynvml functions are called, so a
recording of a real board's answers can stand in for it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace
from typing import Any

log = logging.getLogger(__name__)

# Xid codes after which the GPU needs a reset before it can be trusted
# again (NVIDIA's Xid catalogue: "reset GPU" / "node reboot" actions).
XID_NEEDS_RESET: dict[int, str] = {
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}

# Event drains are bounded: a storm of events must not hold rediscovery.
MAX_EVENTS_PER_DRAIN = 1024


@dataclass(frozen=True)
class GPUHealth:
    """One GPU's health as last read; None for a value not read (see ``not_checked``)."""

    lost: bool = False
    xids: tuple[int, ...] = ()  # Xid codes seen since the agent started, in order, each once
    ecc_uncorrected_volatile: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    retired_pages_pending: bool | None = None
    not_checked: tuple[str, ...] = ()  # "what: why", one per check NVML could not answer

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        if self.lost:
            d["lost"] = True
        if self.xids:
            d["xid"] = list(self.xids)
        for key in ("ecc_uncorrected_volatile", "remapped_rows_pending", "remapped_rows_failure",
                    "retired_pages_pending"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.not_checked:
            d["not_checked"] = list(self.not_checked)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GPUHealth":
        def opt_bool(key: str) -> bool | None:
            return None if d.get(key) is None else bool(d[key])

        ecc = d.get("ecc_uncorrected_volatile")
        return cls(lost=bool(d.get("lost", False)),
                   xids=tuple(dict.fromkeys(int(x) for x in d.get("xid", ()))),
                   ecc_uncorrected_volatile=None if ecc is None else int(ecc),
                   remapped_rows_pending=opt_bool("remapped_rows_pending"),
                   remapped_rows_failure=opt_bool("remapped_rows_failure"),
                   retired_pages_pending=opt_bool("retired_pages_pending"),
                   not_checked=tuple(str(x) for x in d.get("not_checked", ())))

    def with_xids(self, xids: tuple[int, ...]) -> "GPUHealth":
        return replace(self, xids=tuple(dict.fromkeys(self.xids + xids)))


def sick_reasons(h: GPUHealth) -> list[str]:
    """Why the GPU must not be given out, one phrase per cause; empty when it is fit."""
    out = []
    if h.lost:
        out.append("lost (NVML: GPU is lost, it has fallen off the bus or stopped answering)")
    for x in h.xids:
        if x in XID_NEEDS_RESET:
            out.append(f"Xid {x} ({XID_NEEDS_RESET[x]})")
    if h.ecc_uncorrected_volatile:
        out.append(f"{h.ecc_uncorrected_volatile} uncorrected ECC error(s) since the last reset")
    if h.remapped_rows_failure:
        out.append("row remapping failed")
    if h.remapped_rows_pending:
        out.append("row remapping pending (takes effect at the next GPU reset)")
    if h.retired_pages_pending:
        out.append("retired pages pending (take effect at the next GPU reset)")
    return out


# --- NVML ---------------------------------------------------------------------


def _code(nvml: Any, err: BaseException) -> int | None:
    return getattr(err, "value", None) if isinstance(err, nvml.NVMLError) else None


def _unsupported(nvml: Any, err: BaseException) -> bool:
    return _code(nvml, err) in (getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", None),
                                getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", None))


def _is_lost(nvml: Any, err: BaseException) -> bool:
    return _code(nvml, err) == getattr(nvml, "NVML_ERROR_GPU_IS_LOST", None)


class _Lost(Exception):
    """A per-device call answered NVML_ERROR_GPU_IS_LOST."""


@dataclass
class _Reading:
    index: int
    values: dict[str, Any] = field(default_factory=dict)
    not_checked: list[str] = field(default_factory=list)


class NvmlHealth:
    """Reads every GPU's health through NVML; holds one NVML session and event set for its life.

    ``read()`` never raises.  NVML initialisation is reference counted, so
    this session's ``nvmlInit`` keeps the event set valid while discovery
    opens and closes its own.
    """

    def __init__(self, nvml: Any = None):
        self._nvml = nvml
        self._started = False
        self._events: Any = None
        self._registered: set[int] = set()
        self._xid_unchecked: dict[int, str] = {}
        self._said: set[tuple[int, str]] = set()
        self._lock = threading.Lock()

    def _start(self) -> bool:
        if self._started:
            return True
        if self._nvml is None:
            try:
                import pynvml
            except ImportError as e:
                log.info("GPU health not checked: pynvml is not installed (%s)", e)
                return False
            self._nvml = pynvml
        try:
            self._nvml.nvmlInit()
        except Exception as e:  # noqa: BLE001 - discovery reports why there is no NVML
            log.debug("GPU health: nvmlInit failed: %s", e)
            return False
        self._started = True
        try:
            self._events = self._nvml.nvmlEventSetCreate()
        except Exception as e:  # noqa: BLE001 - no events means Xid not checked, said per GPU
            self._events = None
            self._xid_unchecked[-1] = f"nvmlEventSetCreate: {e}"
        return True

    def close(self) -> None:
        with self._lock:
            if not self._started:
                return
            nvml = self._nvml
            if self._events is not None:
                try:
                    nvml.nvmlEventSetFree(self._events)
                except Exception as e:  # noqa: BLE001
                    log.debug("nvmlEventSetFree: %s", e)
            try:
                nvml.nvmlShutdown()
            except Exception as e:  # noqa: BLE001
                log.debug("nvmlShutdown: %s", e)
            self._started, self._events, self._registered = False, None, set()

    def read(self) -> dict[int, GPUHealth]:
        """Each GPU's health by NVML index ({} when NVML cannot be used at all)."""
        with self._lock:
            if not self._start():
                return {}
            nvml = self._nvml
            try:
                count = int(nvml.nvmlDeviceGetCount())
            except Exception as e:  # noqa: BLE001 - discovery says why it sees no GPUs
                log.warning("GPU health not read: nvmlDeviceGetCount: %s", e)
                return {}
            out: dict[int, GPUHealth] = {}
            handles: dict[int, Any] = {}
            for index in range(count):
                try:
                    handle = self._call(nvml.nvmlDeviceGetHandleByIndex, index)
                except _Lost:
                    out[index] = GPUHealth(lost=True)
                    continue
                except Exception as e:  # noqa: BLE001
                    out[index] = GPUHealth(not_checked=(f"everything: nvmlDeviceGetHandleByIndex: {e}",))
                    self._say(index, out[index].not_checked[0], logging.WARNING)
                    continue
                handles[index] = handle
                out[index] = self._read_one(index, handle)
            xids = self._drain(nvml)
            for index, codes in xids.items():
                if index in out:
                    out[index] = out[index].with_xids(tuple(codes))
            return out

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._nvml.NVMLError as e:
            if _is_lost(self._nvml, e):
                raise _Lost(fn.__name__) from e
            raise

    def _say(self, index: int, text: str, level: int = logging.INFO) -> None:
        if (index, text) not in self._said:
            self._said.add((index, text))
            log.log(level, "GPU %d health: not checked: %s", index, text)

    def _check(self, r: _Reading, what: str, call: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)``; on NOT_SUPPORTED or another error, note ``what`` as not checked and return None."""
        try:
            return self._call(fn, *args)
        except _Lost:
            raise
        except Exception as e:  # noqa: BLE001 - one check failing leaves it unchecked, never sick
            unsupported = _unsupported(self._nvml, e)
            text = f"{what}: {call}: {e}"
            r.not_checked.append(text)
            self._say(r.index, text, logging.INFO if unsupported else logging.WARNING)
            return None

    def _read_one(self, index: int, handle: Any) -> GPUHealth:
        nvml = self._nvml
        r = _Reading(index)
        try:
            self._register(r, handle)
            ecc = self._check(r, "uncorrected ECC errors", "nvmlDeviceGetTotalEccErrors",
                              nvml.nvmlDeviceGetTotalEccErrors, handle,
                              nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
            rows = self._check(r, "row remapping", "nvmlDeviceGetRemappedRows",
                               nvml.nvmlDeviceGetRemappedRows, handle)
            pages = None
            if rows is None:
                pages = self._check(r, "retired pages", "nvmlDeviceGetRetiredPagesPendingStatus",
                                    nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        except _Lost:
            return GPUHealth(lost=True)
        return GPUHealth(
            ecc_uncorrected_volatile=None if ecc is None else int(ecc),
            remapped_rows_pending=None if rows is None else bool(rows[2]),
            remapped_rows_failure=None if rows is None else bool(rows[3]),
            retired_pages_pending=None if pages is None else int(pages) == int(nvml.NVML_FEATURE_ENABLED),
            not_checked=tuple(r.not_checked) + self._xid_note(index))

    def _xid_note(self, index: int) -> tuple[str, ...]:
        why = self._xid_unchecked.get(index) or self._xid_unchecked.get(-1)
        if why is None:
            return ()
        text = f"Xid events: {why}"
        self._say(index, text, logging.INFO)
        return (text,)

    def _register(self, r: _Reading, handle: Any) -> None:
        nvml = self._nvml
        if r.index in self._registered or self._events is None or r.index in self._xid_unchecked:
            return
        wanted = int(nvml.nvmlEventTypeXidCriticalError) | int(nvml.nvmlEventTypeDoubleBitEccError)
        try:
            supported = int(self._call(nvml.nvmlDeviceGetSupportedEventTypes, handle)) & wanted
            if not supported & int(nvml.nvmlEventTypeXidCriticalError):
                self._xid_unchecked[r.index] = "the device does not support Xid critical-error events"
                return
            self._call(nvml.nvmlDeviceRegisterEvents, handle, supported, self._events)
        except _Lost:
            raise
        except Exception as e:  # noqa: BLE001 - Xid not checked on this GPU, said in its health
            self._xid_unchecked[r.index] = f"nvmlDeviceRegisterEvents: {e}"
            return
        self._registered.add(r.index)

    def _drain(self, nvml: Any) -> dict[int, list[int]]:
        """Every event waiting in the set, without blocking: Xid codes by GPU index."""
        if self._events is None or not self._registered:
            return {}
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
        found: dict[int, list[int]] = {}
        for _ in range(MAX_EVENTS_PER_DRAIN):
            try:
                ev = wait(self._events, 0)
            except nvml.NVMLError as e:
                if _code(nvml, e) != nvml.NVML_ERROR_TIMEOUT:
                    log.warning("GPU health: reading Xid events: nvmlEventSetWait: %s", e)
                break
            try:
                index = int(nvml.nvmlDeviceGetIndex(ev.device))
            except nvml.NVMLError as e:
                log.warning("GPU health: an event for a device NVML cannot name (%s): type 0x%x data %d",
                            e, int(ev.eventType), int(ev.eventData))
                continue
            etype = int(ev.eventType)
            if etype & int(nvml.nvmlEventTypeXidCriticalError):
                code = int(ev.eventData)
            elif etype & int(nvml.nvmlEventTypeDoubleBitEccError):
                code = 48
            else:
                continue
            level = logging.ERROR if code in XID_NEEDS_RESET else logging.WARNING
            log.log(level, "GPU %d: Xid %d%s", index, code,
                    f" ({XID_NEEDS_RESET[code]}): withheld until the agent restarts" if code in XID_NEEDS_RESET
                    else " (not one that needs a GPU reset; the GPU stays in use)")
            found.setdefault(index, []).append(code)
        return found


class XidLatch:
    """Xid codes seen per GPU since the agent started: an event is never taken back."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[int, ...]] = {}

    def latch(self, health: dict[int, GPUHealth]) -> dict[int, GPUHealth]:
        out = dict(health)
        for index, h in health.items():
            if h.xids:
                self.seen[index] = tuple(dict.fromkeys(self.seen.get(index, ()) + h.xids))
        for index, codes in self.seen.items():
            if index in out:
                out[index] = out[index].with_xids(codes)
            else:
                out[index] = GPUHealth(xids=codes)
        return out
