"""One node, one group: which of its free GPUs a shard would get, or why none.

Both single-node and multi-node placement ask every node this same
question; they differ only in how they choose among the answers.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.placement import nvlink
from llmgw.placement.memory import UNKNOWN_NOTE, MemoryNeed
from llmgw.placement.types import NodeCapacity

# Lifecycle states that read as themselves in a verdict; any other reason a
# node is not schedulable (draining, cordoned, ...) is quoted after
# "not schedulable:".
_SELF_EXPLAINING = ("unreachable", "lost")


@dataclass(frozen=True)
class Refusal:
    """Why a node cannot take part.  ``kind`` groups refusals in a summary."""

    node_id: str
    kind: str  # "unreachable" | "not schedulable" | "too few free GPUs" | "memory" | ...
    text: str


@dataclass(frozen=True)
class NodeOption:
    """A group of free GPUs a node could give, and how it was chosen."""

    node: NodeCapacity
    gpus: tuple[int, ...]
    nvlink: bool  # the group is fully connected by NVLink
    why: str  # "fully connected by NVLink", "lowest free indices; ..."
    free_count: int
    memory_note: str

    @property
    def node_id(self) -> str:
        return self.node.node_id

    @property
    def stranded(self) -> int:
        """Free GPUs the group leaves behind on this node."""
        return self.free_count - len(self.gpus)

    @property
    def rule(self) -> str:
        return "nvlink" if self.nvlink else "lowest-free"

    def describe(self, memory: bool = True) -> str:
        """ "GPUs 2,3 on gpu-a: fully connected by NVLink; memory: ..."."""
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


def _lowest_feasible(free: list[int], n: int, mem: dict[int, int], required: int | None) -> tuple[int, ...]:
    """The lowest ``n`` free indices whose memory adds up to ``required``.

    Greedy in index order: take a GPU whenever the GPUs after it can still
    complete the group.  The caller has checked that the best group is
    enough, so this always completes; on a node of identical GPUs it is just
    the first ``n``.
    """
    if required is None:
        return tuple(free[:n])
    chosen: list[int] = []
    total = 0
    for i, g in enumerate(free):
        need = n - len(chosen)
        if need == 0:
            break
        if len(free) - i < need:
            break
        rest = sorted((mem[x] for x in free[i + 1 :]), reverse=True)[: need - 1]
        if total + mem[g] + sum(rest) >= required:
            chosen.append(g)
            total += mem[g]
    return tuple(chosen)


def choose_group(node: NodeCapacity, n: int, need: MemoryNeed | None) -> NodeOption | Refusal:
    """The group of ``n`` free GPUs this node would give, or why it cannot.

    Preference: the lowest fully NVLink-connected set that holds the
    weights; else the lowest free indices that hold them.
    """
    refused = schedulability(node)
    if refused is not None:
        return refused
    inv = node.inventory
    mem = {g.index: g.memory_bytes for g in inv.gpus}
    # A free index the inventory does not list is not a GPU we can hand out.
    free = sorted(i for i in node.free_gpus if i in mem)
    if len(free) < n:
        if not inv.gpus and inv.gpu_reason:
            text = f"no GPUs ({inv.gpu_reason}), needs {n}"
        elif inv.gpu_reason:  # some GPUs withheld (e.g. held by a stray process): say why there are fewer
            text = f"{plural(len(free), 'free GPU')} ({inv.gpu_reason}), needs {n}"
        else:
            text = f"{plural(len(free), 'free GPU')}, needs {n}"
        return Refusal(node.node_id, "too few free GPUs", text)

    required = need.required_bytes if need is not None else None
    if need is not None:
        best = sorted((mem[g] for g in free), reverse=True)[:n]
        if sum(best) < need.required_bytes:
            uniform = len({mem[g] for g in free}) == 1
            return Refusal(
                node.node_id, "group memory too small", need.refusal(n, sum(best), largest=not uniform)
            )

    def holds(group: tuple[int, ...]) -> bool:
        return required is None or sum(mem[g] for g in group) >= required

    free_text = ",".join(str(g) for g in free)
    why_not: str
    if n == 1:
        why_not = ""
    elif not inv.nvlink_known:
        why_not = "NVLink topology unknown"
    else:
        adj = nvlink.peer_graph(inv)
        found = nvlink.lowest_clique(free, n, adj, accept=holds, max_steps=nvlink.DEFAULT_MAX_STEPS)
        if found.group is not None:
            return _option(node, found.group, True, "fully connected by NVLink", len(free), need, mem)
        if found.exhausted:
            why_not = f"NVLink search stopped after {found.steps} steps"
        elif (
            required is not None
            and nvlink.lowest_clique(free, n, adj, max_steps=nvlink.DEFAULT_MAX_STEPS).group is not None
        ):
            why_not = f"no NVLink-connected set of {n} among free GPUs {free_text} holds the weights"
        else:
            why_not = f"no NVLink-connected set of {n} among free GPUs {free_text}"
    group = _lowest_feasible(free, n, mem, required)
    why = "lowest free index" if n == 1 else "lowest free indices"
    if required is not None and group != tuple(free[:n]):
        why += " that hold the weights"
    if why_not:
        why += f"; {why_not}"
    return _option(node, group, False, why, len(free), need, mem)


def _option(
    node: NodeCapacity,
    group: tuple[int, ...],
    linked: bool,
    why: str,
    free_count: int,
    need: MemoryNeed | None,
    mem: dict[int, int],
) -> NodeOption:
    note = UNKNOWN_NOTE if need is None else need.note(len(group), sum(mem[g] for g in group))
    return NodeOption(node=node, gpus=group, nvlink=linked, why=why, free_count=free_count, memory_note=note)
