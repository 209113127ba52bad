"""Multi-node placement: one shard per node, all on one fabric.

Fabric membership is configuration, and the agent advertises a fabric on a
node only with adapters that are present and have an ACTIVE port; a node
whose adapters are not is left out here rather than started to hang on its
first all-reduce.  A collective runs at the speed of its slowest link, so a
set of nodes is worth the slowest rate among them, and the fastest such set
wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmgw.hardware.types import FabricStatus
from llmgw.placement.group import NodeOption, Refusal, choose_group, plural
from llmgw.placement.memory import UNKNOWN_NOTE, memory_need
from llmgw.placement.summary import summarise
from llmgw.placement.types import (
    NodeCapacity,
    NodeVerdict,
    Placement,
    PlacementRequest,
    PlacementResult,
    ShardPlan,
)


def nccl_ib_hca(adapters: Sequence[str]) -> str:
    """NCCL_IB_HCA naming exactly these adapters.

    NCCL reads each entry as a name prefix unless the list starts with '=',
    so a bare "mlx5_1" would also select mlx5_10 to mlx5_19, adapters this
    node never validated.
    """
    names = list(dict.fromkeys(adapters))
    if not names:
        raise ValueError("NCCL_IB_HCA needs at least one adapter")
    return "=" + ",".join(names)


def shard_env(status: FabricStatus) -> dict[str, str]:
    """What NCCL must be told on this node: exactly the usable ports, and for
    RoCE the GID index (RoCE v2) each node found for its own ports."""
    env = {"NCCL_IB_HCA": nccl_ib_hca(status.advertised_hcas)}
    if status.link_layer == "Ethernet" and status.gid_index is not None:
        env["NCCL_IB_GID_INDEX"] = str(status.gid_index)
    return env


def _rate_key(rate: float | None) -> float:
    # An unknown rate ranks below every known one.
    return -1.0 if rate is None else rate


def _rate_text(rate: float | None) -> str:
    return "rate unknown" if rate is None else f"{rate:g} Gb/s"


@dataclass(frozen=True)
class _Member:
    option: NodeOption
    status: FabricStatus

    def preference(self) -> tuple:
        return self.option.preference


@dataclass(frozen=True)
class _Candidate:
    fabric: str
    members: tuple[_Member, ...]  # in rank order

    @property
    def rate(self) -> float | None:
        rates = [m.status.rate_gbps for m in self.members]
        return None if any(r is None for r in rates) else min(rates)  # type: ignore[type-var]

    def preference(self) -> tuple[float, int, int, tuple[str, ...], str]:
        return (
            -_rate_key(self.rate),
            sum(not m.option.nvlink for m in self.members),
            sum(m.option.stranded for m in self.members),
            tuple(sorted(m.option.node_id for m in self.members)),
            self.fabric,
        )


def _best_on_fabric(fabric: str, members: list[_Member], k: int) -> _Candidate | None:
    """The ``k`` nodes of one fabric with the highest slowest-rate; among
    nodes fast enough, NVLink groups first, then best fit, then node id."""
    if len(members) < k:
        return None
    for threshold in sorted({_rate_key(m.status.rate_gbps) for m in members}, reverse=True):
        fast = [m for m in members if _rate_key(m.status.rate_gbps) >= threshold]
        if len(fast) >= k:
            return _Candidate(fabric, tuple(sorted(fast, key=_Member.preference)[:k]))
    return None  # unreachable: the lowest threshold admits every member


def _fabric_problems(statuses: Sequence[FabricStatus]) -> list[str]:
    out = []
    for f in statuses:
        problems = "; ".join(f.problems) if f.problems else "no adapter advertised"
        out.append(f"fabric {f.name} problems: {problems}")
    return out


def place_multi(request: PlacementRequest, nodes: Sequence[NodeCapacity]) -> PlacementResult:
    profile = request.profile
    k = profile.nodes
    gpn = profile.gpus_per_node
    needs = f"{plural(gpn, 'GPU')} on each of {k} nodes on one fabric"
    need = memory_need(request)
    answers = [choose_group(node, gpn, need) for node in nodes]

    # Per fabric, each node's group is chosen again near that fabric's
    # advertised adapters (GPUDirect RDMA is fastest through the same PCIe
    # switch, slowest across sockets); it differs only where those adapters'
    # places are known.
    # Nodes whose fabric of one name differs in link layer (InfiniBand on
    # some, RoCE on others) are never grouped: their ports cannot talk.
    # The ranks of one replica are one GPU model, as a group on one node is:
    # each node offers a group per model it has, and members gather per model.
    by_fabric: dict[tuple[str, str | None, str], list[_Member]] = {}
    on_fabric: dict[tuple[str, str | None], set[str]] = {}
    for a in answers:
        if isinstance(a, NodeOption):
            for f in a.node.inventory.fabrics:
                if f.usable:
                    on_fabric.setdefault((f.name, f.link_layer), set()).add(a.node_id)
                    for model in a.node_shape.model_names:
                        near = choose_group(a.node, gpn, need, adapters=f.adapter_names(), model=model)
                        if isinstance(near, NodeOption):
                            by_fabric.setdefault((f.name, f.link_layer, model), []).append(_Member(near, f))

    candidates = [c for (name, _layer, _model), ms in by_fabric.items()
                  if (c := _best_on_fabric(name, ms, k)) is not None]
    best = min(candidates, key=_Candidate.preference) if candidates else None

    verdicts: list[NodeVerdict] = []
    refusals: list[Refusal] = []
    for a in answers:
        if isinstance(a, Refusal):
            refusals.append(a)
            verdicts.append(NodeVerdict(a.node_id, False, a.text))
            continue
        inv = a.node.inventory
        usable = [f for f in inv.fabrics if f.usable]
        unusable = [f for f in inv.fabrics if not f.usable]
        if not usable:
            detail = "; ".join(_fabric_problems(unusable)) or "no fabric declared"
            r = Refusal(a.node_id, "no usable fabric", f"not on a fabric with an active adapter: {detail}")
            refusals.append(r)
            verdicts.append(NodeVerdict(a.node_id, False, r.text))
            continue
        if best is None:
            parts = []
            for f in usable:
                c = len(on_fabric[(f.name, f.link_layer)])
                most = max((len(ms) for (name, layer, _m), ms in by_fabric.items()
                            if (name, layer) == (f.name, f.link_layer)), default=0)
                parts.append(
                    f"only {plural(c, 'node')} on fabric {f.name} {'has' if c == 1 else 'have'} "
                    f"{plural(gpn, 'free GPU')}, needs {k}" if most == c else
                    f"only {most} of the {plural(c, 'node')} on fabric {f.name} with {plural(gpn, 'free GPU')} "
                    f"have them of one GPU model, needs {k}"
                )
            parts += _fabric_problems(unusable)
            r = Refusal(a.node_id, "fabric too small", "; ".join(parts))
            refusals.append(r)
            verdicts.append(NodeVerdict(a.node_id, False, r.text))
            continue
        verdicts.append(_fitting_verdict(a, best, usable))

    if best is None:
        return PlacementResult(
            placement=None, verdicts=tuple(verdicts), reason=summarise(request, needs, refusals)
        )

    shards = tuple(
        ShardPlan(
            node_id=m.option.node_id,
            rank=rank,
            gpu_indices=m.option.gpus,
            env=shard_env(m.status),
        )
        for rank, m in enumerate(best.members)
    )
    ranks = "; ".join(f"rank {i}: {m.option.describe(memory=False)}" for i, m in enumerate(best.members))
    memory = UNKNOWN_NOTE if need is None else f"memory: {need.describe()}"
    detail = f"{plural(k, 'node')} on fabric {best.fabric} ({_rate_text(best.rate)}, slowest link): {ranks}; {memory}"
    placement = Placement(
        shards=shards, rule="multi-node", detail=detail, fabric=best.fabric, fabric_rate_gbps=best.rate
    )
    return PlacementResult(placement=placement, verdicts=tuple(verdicts))


def _fitting_verdict(option: NodeOption, best: _Candidate, usable: list[FabricStatus]) -> NodeVerdict:
    """Verdict for a node that could have taken a shard: chosen, or why not."""
    for rank, m in enumerate(best.members):
        if m.option.node_id == option.node_id:
            return NodeVerdict(
                option.node_id,
                True,
                f"chosen: rank {rank}, {m.option.describe()}; fabric {best.fabric} via "
                f"{', '.join(m.status.advertised_hcas)} ({_rate_text(m.status.rate_gbps)})",
            )
    fits = f"fits ({option.describe(memory=False)})"
    mine = next((f for f in usable if f.name == best.fabric), None)
    if mine is None:
        names = ", ".join(f.name for f in usable)
        return NodeVerdict(
            option.node_id,
            True,
            f"{fits} on fabric {names}, not chosen: fabric {best.fabric} preferred ({_rate_text(best.rate)})",
        )
    worst = best.members[-1]
    if _rate_key(mine.rate_gbps) < _rate_key(best.rate):
        why = (
            f"its link on {best.fabric} ({_rate_text(mine.rate_gbps)}) is slower than {_rate_text(best.rate)}"
        )
    elif worst.option.nvlink and not option.nvlink:
        why = "enough nodes offer NVLink-connected sets"
    elif worst.option.stranded < option.stranded:
        why = "enough nodes fit better"
    else:
        why = "enough nodes fit as well and come first by node id"
    return NodeVerdict(option.node_id, True, f"{fits} on fabric {best.fabric}, not chosen: {why}")
