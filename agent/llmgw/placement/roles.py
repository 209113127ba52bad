"""Placement of one replica of a prefill/decode group: where its KV transfers can go.

A decode replica pulls the KV blocks of every prompt a prefill replica ran,
over RDMA through UCX (vLLM's NixlConnector).  Two replicas can pair only if
the transfer has a path: the same node, or nodes on one validated fabric of
one link layer (the membership rule multi-node placement uses, and for the
same reason: nothing on the wire proves it).  So a replica of one group is
placed only on a node that hosts, or shares a usable fabric with, every node
the other group's replicas already run on; the first group placed is free,
and the second follows it.  Everything else (GPU choice, memory, best fit)
is ``place``'s.

The adapters the engine should use are part of the answer:
``UCX_NET_DEVICES`` names the shared fabric's advertised ports nearest the
chosen GPUs (by PCI path and NUMA node, where the inventory knows them;
all of the fabric's advertised ports where it does not).  A replica whose
peers are all on its own node, or a node with no usable fabric, gets none:
UCX then picks its own (shared memory and TCP).  ``UCX_TLS`` stays the
operator's (profile ``env``): which transports a site allows is policy.

Pure: nodes and peers in, a ``PlacementResult`` out.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from llmgw.catalog import other_role, peer_profile_name
from llmgw.hardware.topology import pci_tier, rank
from llmgw.hardware.types import FabricStatus, HardwareInventory
from llmgw.placement.place import place
from llmgw.placement.types import NodeCapacity, NodeVerdict, PlacementRequest, PlacementResult

UCX_NET_DEVICES = "UCX_NET_DEVICES"


def _fabrics(inv: HardwareInventory) -> dict[tuple[str, str | None], FabricStatus]:
    return {(f.name, f.link_layer): f for f in inv.fabrics if f.usable}


def shared_fabrics(node: HardwareInventory, peer: HardwareInventory | None = None) -> list[FabricStatus]:
    """``node``'s usable fabrics that ``peer`` is also on (same name and link layer); all of them without a peer."""
    mine = _fabrics(node)
    keys = set(mine) if peer is None else set(mine) & set(_fabrics(peer))
    return [mine[k] for k in sorted(keys, key=lambda k: (k[0], k[1] or ""))]


def reaches(node: HardwareInventory, peers: Sequence[HardwareInventory]) -> bool:
    """Whether every peer is ``node`` itself or on a usable fabric with it: a KV transfer has a path."""
    return all(p.node_id == node.node_id or shared_fabrics(node, p) for p in peers)


def ucx_net_devices(fabric: FabricStatus, inv: HardwareInventory, gpus: Sequence[int]) -> str:
    """``UCX_NET_DEVICES`` for an engine on ``gpus``: the fabric's advertised ports nearest them.

    UCX names a port ``<adapter>:<port>``; an adapter advertised whole
    (every port usable) contributes each of its active ports.
    """
    hcas = {h.name: h for h in inv.hcas}
    ports: list[tuple[str, str]] = []  # (adapter, "adapter:port")
    for a in fabric.advertised_hcas:
        name, _, port = a.partition(":")
        if port:
            ports.append((name, a))
        elif name in hcas and hcas[name].active_ports:
            ports += [(name, f"{name}:{p.port}") for p in hcas[name].active_ports]
        else:
            ports.append((name, f"{name}:1"))
    by_index = {g.index: g for g in inv.gpus}
    chosen = [by_index[i] for i in gpus if i in by_index]

    def distance(adapter: str) -> int | None:
        h = hcas.get(adapter)
        if h is None or not h.pci_path or not chosen:
            return None
        return min(rank(pci_tier(g.pci_path, g.numa_node, h.pci_path, h.numa_node)) for g in chosen)

    dist = {name: distance(name) for name, _ in ports}
    known = [d for d in dist.values() if d is not None]
    if known:
        best = min(known)
        ports = [(n, p) for n, p in ports if dist[n] == best]
    return ",".join(dict.fromkeys(p for _, p in ports))


Placed = Mapping[tuple[str, str], Collection[str]]  # (model, profile) -> the nodes its replicas run on


def place_paired(request: PlacementRequest, nodes: Sequence[NodeCapacity], placed: Placed) -> PlacementResult:
    """``place`` for any request: a replica of a prefill/decode group goes where its peers can reach it."""
    peer = peer_profile_name(request.profile)
    if peer is None or request.profile.kv_transfer is None:
        return place(request, nodes)
    role = request.profile.kv_transfer.role
    return place_role(request, nodes, role, other_role(role), placed.get((request.model.name, peer), ()))


def place_role(request: PlacementRequest, nodes: Sequence[NodeCapacity], role: str, peer_role: str,
               peer_nodes: Collection[str]) -> PlacementResult:
    """Where one ``role`` replica goes, given the nodes the ``peer_role`` group already runs on.

    The verdict of every node says which role it was asked for and, for a
    node left out, that it has no path to the peers; the chosen node's says
    how its transfers will go.
    """
    inventories = {n.node_id: n.inventory for n in nodes}
    peers = [inventories[p] for p in sorted(set(peer_nodes)) if p in inventories]
    eligible, refused = [], []
    for n in nodes:
        if reaches(n.inventory, peers):
            eligible.append(n)
        else:
            refused.append(NodeVerdict(
                n.node_id, False,
                f"{role}: no path to the {peer_role} replicas on {', '.join(p.node_id for p in peers)} "
                "(not beside each of them, nor on a usable fabric with it)"))
    result = place(request, eligible)
    verdicts = tuple(NodeVerdict(v.node_id, v.ok, f"{role}: {v.reason}") for v in result.verdicts) + tuple(refused)
    if result.placement is None:
        reason = result.reason or "no placement"
        if refused:
            where = ", ".join(p.node_id for p in peers)
            reason += (f"; {len(refused)} more node{'s' if len(refused) != 1 else ''} with no path to the "
                       f"{peer_role} replicas on {where}")
        return replace(result, verdicts=verdicts, reason=f"{role}: {reason}")
    shard = result.placement.shards[0]
    inv = inventories[shard.node_id]
    others = [p for p in peers if p.node_id != shard.node_id]
    # With peers elsewhere, the fabrics they share; with none yet, every usable fabric of the node, since
    # the other group will be placed on one of them (or beside it, where UCX uses no network device).
    if others:
        fabrics = list({f.name: f for p in others for f in shared_fabrics(inv, p)}.values())
    else:
        fabrics = [] if peers else shared_fabrics(inv)
    env = dict(shard.env)
    if fabrics:
        env[UCX_NET_DEVICES] = ",".join(dict.fromkeys(
            d for f in fabrics for d in ucx_net_devices(f, inv, shard.gpu_indices).split(",")))
    names = ", ".join(f.name for f in fabrics)
    if others:
        path = f"KV transfers to the {peer_role} replicas over fabric {names} via {env[UCX_NET_DEVICES]}"
    elif peers:
        path = f"KV transfers within {shard.node_id}, beside its {peer_role} replicas"
    elif fabrics:
        path = (f"first of its pair: the {peer_role} group follows onto this node or fabric {names} "
                f"(via {env[UCX_NET_DEVICES]})")
    else:
        path = f"first of its pair, on a node with no usable fabric: the {peer_role} group must fit beside it"
    placement = replace(result.placement, shards=(replace(shard, env=env),),
                        detail=f"{role}: {result.placement.detail}; {path}")
    return PlacementResult(placement=placement, verdicts=verdicts)


__all__ = ["UCX_NET_DEVICES", "Placed", "place_paired", "place_role", "reaches", "shared_fabrics", "ucx_net_devices"]
