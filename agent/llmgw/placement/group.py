"""One node, one group: which of its free GPUs a shard would get, or why none.

Both single-node and multi-node placement ask every node this same
question; they differ only in how they choose among the answers.
"""

from __future__ import annotations

from dataclasses import dataclass

from collections.abc import Sequence

from llmgw.hardware.topology import TIERS, UNKNOWN_RANK, label
from llmgw.placement.memory import UNKNOWN_NOTE, MemoryNeed
from llmgw.placement.shape import Choice, NodeShape, adapter_ranks, shape_of
from llmgw.placement.types import NodeCapacity
from llmgw.protocol import NodeState

# Lifecycle states that read as themselves in a verdict; any other reason a
# node is not schedulable (draining, cordoned, ...) is quoted after
# "not schedulable:".
_SELF_EXPLAINING = (NodeState.UNREACHABLE.value, NodeState.LOST.value)


@dataclass(frozen=True)
class Refusal:
    """Why a node cannot take part.  ``kind`` groups refusals in a summary."""

    node_id: str
    kind: str  # "unreachable" | "not schedulable" | "too few free GPUs" | "GPU memory too small" | ...
    text: str


@dataclass(frozen=True)
class NodeOption:
    """A group of free GPUs a node could give, and how it was chosen."""

    node: NodeCapacity
    gpus: tuple[int, ...]
    choice: Choice  # its score and fit (see llmgw.placement.shape)
    why: str  # "fully connected by NVLink (NV4)", "2 NVLink islands (...) joined by NODE (...)"
    free_count: int
    memory_note: str

    @property
    def node_id(self) -> str:
        return self.node.node_id

    @property
    def nvlink(self) -> bool:
        """The group is fully connected by NVLink (a single GPU counts)."""
        return self.choice.worst == 0

    @property
    def node_shape(self) -> NodeShape:
        return shape_of(self.node.inventory)

    @property
    def stranded(self) -> int:
        """Free GPUs the group leaves behind on this node."""
        return self.free_count - len(self.gpus)

    @property
    def preference(self) -> tuple:
        """Lower is better across nodes: link score, then fit, then fewest GPUs left over."""
        return (self.choice.score, self.choice.fit, self.stranded, self.node_id)

    @property
    def rule(self) -> str:
        if len(self.gpus) == 1:
            return "best-fit" if self.choice.passed_over is not None else "lowest-free"
        if self.nvlink:
            return "nvlink"
        return "topology" if self.choice.worst < UNKNOWN_RANK else "lowest-free"

    def describe(self, memory: bool = True) -> str:
        """ "GPUs 2,3 on gpu-a: fully connected by NVLink (NV4); memory: ..."."""
        text = f"{gpu_list(self.gpus)} on {self.node_id}: {self.why}"
        return f"{text}; {self.memory_note}" if memory else text


def gpu_list(gpus: tuple[int, ...] | list[int]) -> str:
    label = "GPU" if len(gpus) == 1 else "GPUs"
    return f"{label} {','.join(str(g) for g in gpus)}"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def schedulability(node: NodeCapacity) -> Refusal | None:
    if node.schedulable:
        return None
    reason = (node.reason or "").strip()
    if reason.lower() in _SELF_EXPLAINING:
        return Refusal(node.node_id, reason.lower(), reason.lower())
    return Refusal(node.node_id, "not schedulable", f"not schedulable: {reason or 'no reason given'}")


def choose_group(node: NodeCapacity, n: int, need: MemoryNeed | None,
                 adapters: Sequence[str] = (), model: str | None = None) -> NodeOption | Refusal:
    """The group of ``n`` free GPUs this node would give, or why it cannot.

    Only GPUs that each hold their share of the weights are candidates; among
    them the best-scored set (``NodeShape.best``), preferring GPUs close to
    ``adapters`` (a multi-node rank's fabric) when their places are known.
    ``model``: only GPUs of that model (a multi-node replica's ranks are one
    model too).
    """
    refused = schedulability(node)
    if refused is not None:
        return refused
    inv = node.inventory
    shape = shape_of(inv)
    free_mask = shape.mask_of(node.free_gpus)
    free_count = free_mask.bit_count()
    if free_count < n:
        return Refusal(node.node_id, "too few free GPUs", _too_few(inv, free_count, n))
    per_gpu = need.per_gpu_bytes if need is not None else None
    mask = free_mask & shape.holding(per_gpu)
    if model is not None:
        mask &= shape.model_mask(model)
    if need is not None and mask.bit_count() < n:
        largest = max((shape.memory[p] for p in range(shape.size) if free_mask >> p & 1), default=0)
        return Refusal(node.node_id, "GPU memory too small",
                       need.refusal(n, mask.bit_count(), free_count, largest))
    near = adapter_ranks(shape, inv, adapters) if adapters else None
    choice = shape.best(mask, n, near)
    if choice is None and model is not None:
        return Refusal(node.node_id, "too few GPUs of one model", f"fewer than {n} free {model} GPUs")
    if choice is None:  # n GPUs, but not n of one model
        return Refusal(node.node_id, "too few GPUs of one model", one_model_refusal(shape, mask, n))
    return NodeOption(node=node, gpus=choice.gpus, choice=choice, why=_why(shape, choice, mask, need, free_mask, near, inv),
                      free_count=free_count, memory_note=_memory_note(shape, choice, need))


def one_model_refusal(shape: NodeShape, mask: int, n: int) -> str:
    """ "4 free GPUs, no 4 of one model (3 NVIDIA H100 80GB HBM3, 1 NVIDIA L40S): a tensor-parallel
    group is one GPU model, needs 4"."""
    counts = [(mm & mask).bit_count() for mm in shape.model_masks]
    have = ", ".join(f"{c} {name}" for c, name in zip(counts, shape.model_names) if c)
    return (f"{plural(mask.bit_count(), 'free GPU')}, no {n} of one model ({have}): a tensor-parallel group "
            f"is one GPU model, needs {n}")


def _too_few(inv, free: int, n: int) -> str:
    if not inv.gpus and inv.gpu_reason:
        return f"no GPUs ({inv.gpu_reason}), needs {n}"
    if inv.gpu_reason:  # some GPUs withheld (e.g. held by a stray process): say why there are fewer
        return f"{plural(free, 'free GPU')} ({inv.gpu_reason}), needs {n}"
    return f"{plural(free, 'free GPU')}, needs {n}"


def _why(shape: NodeShape, choice: Choice, mask: int, need: MemoryNeed | None, free_mask: int,
         near: tuple[int, ...] | None, inv) -> str:
    n = len(choice.gpus)
    parts = [shape.tiers_text(choice)]
    if choice.worst >= UNKNOWN_RANK:
        # Some pair's tier is unknown: say which knowledge was missing.
        if not inv.nvlink_known:
            parts.append("NVLink topology unknown")
        else:
            free = ",".join(str(g) for g in shape.gpus_of(mask))
            parts.append(f"no NVLink-connected set of {n} among free GPUs {free}"
                         + (" that hold their share" if mask != free_mask else ""))
            if not shape.known:
                parts.append("PCIe/NUMA tiers unknown (not discovered)")
    else:
        given = shape.given_up(choice)
        if given:
            if mask != free_mask and shape.best(free_mask, n).score < choice.score:
                given += " that holds its share of the weights"
            parts.append(given)
    fit = shape.fit_text(choice)
    if fit:
        parts.append(fit)
    if near is not None:
        closest = min(near[p] for p in choice.positions)
        parts.append(f"nearest adapter {label(TIERS[closest]) if closest < UNKNOWN_RANK else 'tier unknown'}")
    return "; ".join(p for p in parts if p) or "lowest free index"


def _memory_note(shape: NodeShape, choice: Choice, need: MemoryNeed | None) -> str:
    if need is None:
        return UNKNOWN_NOTE
    return need.note(min(shape.memory[p] for p in choice.positions), len(choice.positions))
