"""Will the weights fit?  Checked before any engine is launched.

An engine that runs out of memory does so after minutes of loading, and
says so in a traceback on a node nobody is watching.  Refusing here puts
the numbers in front of the operator instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmgw.placement.types import PlacementRequest

GIB = 1 << 30

UNKNOWN_NOTE = "weights size unknown: memory not checked"


def gib(n: int | float) -> str:
    return f"{n / GIB:.1f} GiB"


@dataclass(frozen=True)
class MemoryNeed:
    """What one node's group must hold: its share of the weights plus headroom."""

    weights_bytes: int  # the whole model
    headroom: float
    share: int = 1  # this node holds 1/share of the weights (one per node)

    @property
    def required_bytes(self) -> int:
        return math.ceil(self.weights_bytes * (1 + self.headroom) / self.share)

    def describe(self) -> str:
        pct = f"{self.headroom * 100:g}%"
        if self.share == 1:
            weights = f"weights {gib(self.weights_bytes)}"
        else:
            weights = (
                f"1/{self.share} of weights {gib(self.weights_bytes)}"
                f" = {gib(self.weights_bytes / self.share)}"
            )
        return f"needs {gib(self.required_bytes)} ({weights} + {pct} headroom)"

    def refusal(self, group_size: int, group_bytes: int, largest: bool) -> str:
        which = "largest group" if largest else "group"
        return f"group memory too small: {self.describe()}, {which} of {group_size} has {gib(group_bytes)}"

    def note(self, group_size: int, group_bytes: int) -> str:
        return f"memory: {self.describe()}, group of {group_size} has {gib(group_bytes)}"


def memory_need(request: PlacementRequest, share: int = 1) -> MemoryNeed | None:
    """None when the weights' size is unknown: then nothing is checked."""
    if request.weights_bytes is None:
        return None
    if request.weights_bytes < 0:
        raise ValueError(f"weights_bytes must not be negative, got {request.weights_bytes}")
    if request.memory_headroom < 0:
        raise ValueError(f"memory_headroom must not be negative, got {request.memory_headroom}")
    return MemoryNeed(request.weights_bytes, request.memory_headroom, share)
