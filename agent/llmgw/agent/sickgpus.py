"""Withholding unfit GPUs from what the node advertises, and saying why.

The judgement is ``llmgw.hardware.gpu_health``'s; this keeps what must
outlive one rediscovery: the Xid codes seen since the agent started (an
event is never taken back) and when each GPU was first judged sick for its
current reason, so the reason an operator reads, and the document the
control plane compares, stay the same from one rediscovery to the next.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping

from llmgw.hardware.gpu_health import GPUHealth, XidLatch, sick_reasons
from llmgw.hardware.types import HardwareInventory, SickGPU

log = logging.getLogger(__name__)


def utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


class SickGPUs:
    """Applies each rediscovery's health readings to its inventory."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.latch = XidLatch()
        self.since: dict[int, tuple[str, float]] = {}  # GPU -> (reason, first judged so)

    def apply(self, inventory: HardwareInventory, health: Mapping[int, GPUHealth]) -> HardwareInventory:
        """``inventory`` with each GPU's health attached, less the sick ones (``sick_gpus`` says why).

        ``health`` is by NVML index and may name GPUs discovery left out (a
        lost GPU NVML cannot describe): they are listed sick all the same,
        so a replica on one is moved.
        """
        latched = self.latch.latch(dict(health))
        sick: dict[int, str] = {}
        for index, h in sorted(latched.items()):
            reasons = sick_reasons(h)
            if reasons:
                sick[index] = ", ".join(reasons)
        now = self.clock()
        for index in sorted(set(self.since) - set(sick)):
            log.warning("GPU %d healthy again (%s no longer holds); advertised again", index, self.since[index][0])
            del self.since[index]
        for index, reason in sick.items():
            if self.since.get(index, ("", 0.0))[0] != reason:
                self.since[index] = (reason, now)
                log.error("GPU %d withheld: %s", index, reason)
        gpus = tuple(dataclasses.replace(g, health=latched[g.index]) if g.index in latched else g
                     for g in inventory.gpus)
        shown = dataclasses.replace(inventory, gpus=gpus)
        if not sick:
            return shown
        listed = tuple(SickGPU(i, r, self.since[i][1]) for i, r in sick.items())
        parts = [f"GPU {g.index} withheld: {g.reason} at {utc(g.since)}" for g in listed]
        return dataclasses.replace(shown.without_gpus(set(sick), parts), sick_gpus=listed)
