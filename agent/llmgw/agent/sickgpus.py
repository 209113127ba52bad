"""Withholding unfit GPUs from what the node advertises, and saying why.

The judgement is ``llmgw.hardware.gpu_health``'s and what is withheld is
``llmgw.hardware.advertise``'s (the rules offline explain and the control
plane apply too); this keeps what must
outlive one rediscovery: the Xid codes seen since the agent started (an
event is never taken back) and when each GPU was first judged sick for its
current reason, so the reason an operator reads, and the document the
control plane compares, stay the same from one rediscovery to the next.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from llmgw.hardware.advertise import advertise, sick_by_gpu
from llmgw.hardware.gpu_health import GPUHealth, XidLatch
from llmgw.hardware.types import HardwareInventory

log = logging.getLogger(__name__)


class SickGPUs:
    """Applies each rediscovery's health readings to its inventory."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.latch = XidLatch()
        self.since: dict[int, tuple[str, float]] = {}  # GPU -> (reason, first judged so)

    def judge(self, health: Mapping[int, GPUHealth]) -> tuple[dict[int, GPUHealth], dict[int, float]]:
        """The readings with every Xid seen so far, and since when each sick GPU has been so, logged on change."""
        latched = self.latch.latch(dict(health))
        sick = sick_by_gpu(latched)
        now = self.clock()
        for index in sorted(set(self.since) - set(sick)):
            log.warning("GPU %d healthy again (%s no longer holds); advertised again", index, self.since[index][0])
            del self.since[index]
        for index, reason in sick.items():
            if self.since.get(index, ("", 0.0))[0] != reason:
                self.since[index] = (reason, now)
                log.error("GPU %d withheld: %s", index, reason)
        return latched, {i: t for i, (_, t) in self.since.items()}

    def apply(self, inventory: HardwareInventory, health: Mapping[int, GPUHealth]) -> HardwareInventory:
        """``inventory`` with each GPU's health attached, less the sick ones (``sick_gpus`` says why).

        ``health`` is by NVML index and may name GPUs discovery left out (a
        lost GPU NVML cannot describe): they are listed sick all the same,
        so a replica on one is moved.
        """
        latched, since = self.judge(health)
        return advertise(inventory, health=latched, since=since).inventory
