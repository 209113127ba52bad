"""What a node advertises, from what it has: one function for every reader of hardware.

The agent, the control plane and ``llmgw ctl explain`` over hardware files all
start from a node's inventory (GPUs with their health and the processes NVML
lists on them) and must reach the same GPUs to give out.  A second copy of
these rules once drifted (offline explain placed replicas on GPUs whose
``health`` said Xid 79 while the agent withheld them), so they live here,
pure, and each caller brings only what it alone knows:

* the agent: NVML's readings (Xids latched since it started), when each GPU
  was first judged sick, the engines that survived SIGKILL, and which listed
  processes are not its engines (it asks ``/proc``);
* the control plane: nothing; each GPU's own ``health`` block is judged, so a
  GPU an older or faulty agent left in what it advertises is not given out;
* offline explain: nothing either; there is no process to ask, so every
  process a file lists counts as not an engine (``listed_holders``).

Order, and so the words of ``gpu_reason``: sick GPUs first (a sick GPU is
named once, as sick), then GPUs held by engines that could not be stopped,
then GPUs in use by processes that are not engines, judged on what is left.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from llmgw.hardware.gpu_health import GPUHealth, sick_reasons
from llmgw.hardware.types import HardwareInventory, SickGPU


def utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


class Holder(Protocol):
    """A process on a GPU that is not one of the node's engines."""

    gpu: int
    pid: int

    def describe(self) -> str: ...


@dataclass(frozen=True)
class Hold:
    """GPUs held by something that cannot be stopped, and the whole ``gpu_reason`` part saying so."""

    gpus: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class ListedHolder:
    """A process a hardware file lists on a GPU, judged offline (nobody to ask)."""

    gpu: int
    pid: int
    used_memory_bytes: int | None = None

    def describe(self) -> str:
        return f"pid {self.pid} (listed in the hardware file; offline, every listed process counts)"


@dataclass(frozen=True)
class Advertised:
    inventory: HardwareInventory
    sick: tuple[SickGPU, ...] = ()
    holders: tuple[Holder, ...] = ()


def sick_by_gpu(health: Mapping[int, GPUHealth]) -> dict[int, str]:
    """Each unfit GPU's reason (its causes joined), by index."""
    out = {}
    for index, h in sorted(health.items()):
        reasons = sick_reasons(h)
        if reasons:
            out[index] = ", ".join(reasons)
    return out


def listed_holders(inventory: HardwareInventory) -> list[ListedHolder]:
    """Every process a file lists, each counted as not an engine (the offline rule).

    A GPU whose processes are unknown (the key left out) yields nothing, as on
    the agent when NVML cannot list them.
    """
    return [ListedHolder(g.index, p.pid, p.used_memory_bytes) for g in inventory.gpus for p in g.processes or ()]


def advertise(inventory: HardwareInventory, *, health: Mapping[int, GPUHealth] | None = None,
              since: Mapping[int, float] | None = None, now: float | None = None,
              held: Callable[[HardwareInventory], Sequence[Hold]] | None = None,
              foreign: Callable[[HardwareInventory], Sequence[Holder]] | None = None) -> Advertised:
    """``inventory`` as the node advertises it: sick and held GPUs left out, ``gpu_reason`` saying why.

    ``health`` is by GPU index (it may name GPUs the inventory lacks: a lost
    GPU NVML cannot describe is listed sick all the same) and is attached to
    the GPUs; None judges each GPU's own ``health``.  ``since`` is when each
    sick GPU was first judged so; else ``now``; with neither (offline) the
    reason carries no time.  ``held`` finds, on what is left of the
    inventory, the GPUs held by engines that could not be stopped;
    ``foreign`` then finds, on what is left, the
    processes that are not engines; None leaves processes unjudged (the
    control plane cannot tell an engine from anything else).  Nothing
    withheld and ``health`` None: the same inventory object comes back.
    """
    if health is None:
        readings = {g.index: g.health for g in inventory.gpus if g.health is not None}
        shown = inventory
    else:
        readings = dict(health)
        shown = dataclasses.replace(inventory, gpus=tuple(
            dataclasses.replace(g, health=readings[g.index]) if g.index in readings else g for g in inventory.gpus))
    sick = sick_by_gpu(readings)
    listed: tuple[SickGPU, ...] = ()
    if sick:
        since = since or {}
        listed = tuple(SickGPU(i, r, since.get(i, now if now is not None else 0.0)) for i, r in sick.items())
        parts = [f"GPU {s.index} withheld: {s.reason}"
                 + (f" at {utc(s.since)}" if s.index in since or now is not None else "") for s in listed]
        kept = inventory.sick_gpus if health is None else ()  # the agent's own judgement, carried on
        merged = tuple(sorted(kept + tuple(s for s in listed if s.index not in {k.index for k in kept}),
                              key=lambda s: s.index))
        shown = dataclasses.replace(shown.without_gpus(set(sick), parts), sick_gpus=merged)
    holds = held(shown) if held is not None else ()
    if holds:
        shown = shown.without_gpus({g for h in holds for g in h.gpus}, [h.reason for h in holds])
    holders: tuple[Holder, ...] = ()
    if foreign is not None:
        holders = tuple(foreign(shown))
        by_gpu: dict[int, list[Holder]] = {}
        for holder in holders:
            by_gpu.setdefault(holder.gpu, []).append(holder)
        parts = []
        for idx, hs in sorted(by_gpu.items()):
            tail = "not an llmgw engine" if len(hs) == 1 else "none of them an llmgw engine"
            parts.append(f"GPU {idx} withheld: in use by {', '.join(h.describe() for h in hs)}, {tail}")
        if parts:
            shown = shown.without_gpus(set(by_gpu), parts)
    return Advertised(shown, listed, holders)
