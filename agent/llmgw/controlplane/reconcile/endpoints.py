"""The rank-0 endpoints the router should know, read from the book."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmgw.controlplane.reconcile.plan import NodeView
from llmgw.controlplane.replicas import DRAINING, READY, ReplicaBook, ReplicaState


def endpoints(book: ReplicaBook, nodes: Mapping[str, NodeView]) -> list[dict[str, Any]]:
    """Rank-0 endpoints the router should know: Ready replicas, and draining ones marked so.

    A replica on an unreachable node stays: its engine may still serve, and
    the router finds out for itself (breaker) far faster than a lifecycle can.
    """
    out = []
    for r in sorted(book.replicas.values(), key=lambda r: r.replica_id):
        r0 = r.shards.get(0)
        if r0 is None or r0.node_id is None or not r0.port:
            continue
        if not r.retired and r.state is ReplicaState.READY:
            draining = False
        elif r.retired and r.draining and r0.state in (READY, DRAINING):
            draining = True
        else:
            continue
        host = r0.address or (nodes[r0.node_id].address if r0.node_id in nodes else None)
        if not host:
            continue
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        model = r0.spec.get("model", {})
        profile = r0.spec.get("profile", {})
        ep = {"id": r.replica_id, "model": model.get("served_name") or r.model,
              "url": f"{r0.scheme}://{host}:{r0.port}", "replica_id": r.replica_id, "draining": draining,
              "max_concurrency": profile.get("max_concurrency"), "api_key": r0.spec.get("api_key")}
        kv = profile.get("kv_transfer")
        if kv:  # one side of a prefill/decode pair; only when set: a router that predates roles refuses the key
            ep["role"] = kv["role"]
            if profile.get("engine") == "sglang" and kv["role"] == "prefill":
                # SGLang's router names the prefill's bootstrap server in every request (dual dispatch);
                # until the agent has said which port it is, the replica cannot be used
                if r0.side_port is None:
                    continue
                ep["bootstrap_port"] = r0.side_port
            elif profile.get("engine") == "sglang":
                ep["requires_prefill"] = True  # an SGLang decode server cannot prefill a request itself
        if r0.sleeping:  # scale to sleep, only when set: a router that predates it refuses the key
            ep["sleeping"] = True
        out.append(ep)
    return out
