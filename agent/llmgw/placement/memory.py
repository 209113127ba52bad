"""Will each GPU hold its share of the weights?  Checked before any engine is launched.

An engine that runs out of memory does so after minutes of loading, and
says so in a traceback on a node nobody is watching.  Refusing here puts
the numbers in front of the operator instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmgw.engines import ENGINES
from llmgw.engines.common import MemoryFraction
from llmgw.placement.types import PlacementRequest

GIB = 1 << 30

UNKNOWN_NOTE = "weights size unknown: memory not checked"


def gib(n: int | float) -> str:
    return f"{n / GIB:.1f} GiB"


@dataclass(frozen=True)
class MemoryNeed:
    """What each GPU of a replica must hold: its share of the weights plus headroom.

    Tensor and pipeline parallelism split the weights evenly over every GPU
    of the replica, so each GPU must hold ``1/gpus`` of them: a group total
    would let a 48 GB and a 24 GB card take a 50 GiB model, and the smaller
    one would run out of memory after minutes of loading.

    An engine told to take only part of each card (vLLM's
    ``--gpu-memory-utilization``, SGLang's ``--mem-fraction-static``) must
    fit that share within its part: 40 GiB of weights do not load on an
    80 GB card with ``--gpu-memory-utilization 0.5``.  ``per_gpu_bytes`` is
    then the card each GPU must be.
    """

    weights_bytes: int  # the whole model
    headroom: float
    gpus: int = 1  # GPUs of the whole replica (nodes x GPUs per node)
    fraction: float | None = None  # the engine's own cap on its share of each GPU
    fraction_flag: str = ""

    @property
    def share_bytes(self) -> int:
        """Each GPU's share of the weights, with headroom."""
        return math.ceil(self.weights_bytes * (1 + self.headroom) / self.gpus)

    @property
    def per_gpu_bytes(self) -> int:
        """The memory each GPU must have: its share, within the engine's cap when one is set."""
        if self.fraction is None:
            return self.share_bytes
        return math.ceil(self.share_bytes / self.fraction)

    def describe(self) -> str:
        pct = f"{self.headroom * 100:g}%"
        if self.gpus == 1:
            text = f"needs {gib(self.share_bytes)} (weights {gib(self.weights_bytes)} + {pct} headroom)"
        else:
            text = (f"each GPU needs {gib(self.share_bytes)} (1/{self.gpus} of weights {gib(self.weights_bytes)}"
                    f" = {gib(self.weights_bytes / self.gpus)} + {pct} headroom)")
        if self.fraction is not None:
            text += f" within {self.fraction_flag} {self.fraction:g}: a GPU of {gib(self.per_gpu_bytes)}"
        return text

    def refusal(self, n: int, holding: int, free: int, largest: int) -> str:
        """Why no ``n`` free GPUs hold their share: how many do, and the largest."""
        return (f"GPU memory too small: {self.describe()}, {holding} of {free} free GPUs "
                f"{'holds' if holding == 1 else 'hold'} it (largest has {gib(largest)}), needs {n}")

    def note(self, smallest: int, n: int) -> str:
        which = "GPU has" if n == 1 else "smallest GPU of the group has"
        return f"memory: {self.describe()}, {which} {gib(smallest)}"


def memory_need(request: PlacementRequest) -> MemoryNeed | None:
    """None when the weights' size is unknown: then nothing is checked."""
    if request.weights_bytes is None:
        return None
    if request.weights_bytes < 0:
        raise ValueError(f"weights_bytes must not be negative, got {request.weights_bytes}")
    if request.memory_headroom < 0:
        raise ValueError(f"memory_headroom must not be negative, got {request.memory_headroom}")
    cap = engine_fraction(request)
    return MemoryNeed(request.weights_bytes, request.memory_headroom, max(1, request.profile.gpus_total),
                      cap.value if cap is not None else None, cap.flag if cap is not None else "")


def engine_fraction(request: PlacementRequest) -> MemoryFraction | None:
    """The profile's cap on the engine's share of each GPU, as its adapter reads its flags."""
    adapter = ENGINES.get(request.profile.engine)  # an engine no adapter knows is refused at config load
    return adapter.memory_fraction(request.profile) if adapter is not None else None
