"""The reconciler's own test fleet (no tests here): a catalog, nodes that report, and what the
reconciler asked them to start and stop."""

from __future__ import annotations

import itertools
from typing import Any

from llmgw.catalog import Catalog
from llmgw.controlplane.grants import GrantKeys, issue
from llmgw.controlplane.lifecycle import NodeState, ReplacementLimiter
from llmgw.controlplane.reconciler import Context, NodeView, Reconciler, Start, Stop
from llmgw.hardware.types import GPU, FabricStatus, HardwareInventory
from llmgw.settings import RestartPolicy


GIB = 1 << 30


POLICY = RestartPolicy(backoff_initial=5, backoff_max=40)


# The grant secret of "the" control plane: a restarted one (a new Fleet) reads the same file.
KEYS = GrantKeys((b"s" * 32,))


def granted(spec: dict[str, Any], node: str, keys: GrantKeys = KEYS, nonce: str = "00" * 16) -> dict[str, Any]:
    """``spec`` with a grant for ``node``, as a control plane with ``keys`` would have issued it."""
    return {**spec, "grant": issue(keys, replica_id=spec["replica_id"], slot=0, model=spec["model"]["name"],
                                   profile=spec["profile"]["name"], node_id=node, rank=spec["rank"],
                                   nnodes=spec["nnodes"], issued_at=0, cp_epoch=1, nonce=nonce)}


def catalog(replicas: int = 2, profile: dict[str, Any] | None = None, model: str = "tiny",
            extra: list[dict[str, Any]] | None = None) -> Catalog:
    prof = {"name": "sim", "engine": "vllm", "start_timeout": 60, **(profile or {})}
    deps = [{"model": model, "profile": prof["name"], "replicas": replicas}] + (extra or [])
    return Catalog.from_config({
        "models": [{"name": "tiny", "source": "/models/tiny", "size_bytes": GIB},
                   {"name": "other", "source": "org/other"}],
        "profiles": [prof, {"name": "big", "engine": "vllm", "tensor_parallel_size": 2, "nodes": 2}],
        "deployments": deps,
    })


def inventory(node_id: str, gpus: int = 2, fabric: str | None = None) -> HardwareInventory:
    fabrics = (FabricStatus(fabric, ("mlx5_0",), ("mlx5_0",), 200.0),) if fabric else ()
    return HardwareInventory(
        node_id=node_id, gpu_source="simulated", fabrics=fabrics,
        gpus=tuple(GPU(i, f"GPU-{node_id}-{i}", "Sim", 80 * GIB, f"00000000:{i + 1:02x}:00.0") for i in range(gpus)))


class Fleet:
    """Nodes, epochs and a reconciler; ``step`` runs one pass and returns its actions."""

    def __init__(self, *names: str, gpus: int = 2, fabric: str | None = None, rec: Reconciler | None = None):
        counter = itertools.count()
        self.rec = rec or Reconciler(rand=lambda: f"{next(counter):04x}", keys=KEYS)
        self.nodes: dict[str, NodeView] = {}
        self.limiter = ReplacementLimiter(per_minute=10)
        for n in names:
            self.nodes[n] = NodeView(n, NodeState.READY, True, 1, inventory(n, gpus, fabric), address=f"10.0.0.{len(self.nodes) + 1}")

    def set(self, node: str, **kw: Any) -> None:
        v = self.nodes[node]
        self.nodes[node] = NodeView(**{**v.__dict__, **kw})

    def register(self, node: str, reports: list[dict[str, Any]], now: float) -> list[str]:
        v = self.nodes[node]
        self.set(node, epoch=v.epoch + 1, connected=True, state=NodeState.READY)
        return self.rec.observe_register(node, reports, now)

    def step(self, cat: Catalog, now: float, **ctx: Any):
        c = Context(restart=POLICY, memory_headroom=0.2, limiter=self.limiter, **ctx)
        return self.rec.reconcile(cat, self.nodes, now, c)


def starts(plan) -> list[Start]:
    return [a for a in plan.actions if isinstance(a, Start)]


def stops(plan) -> list[Stop]:
    return [a for a in plan.actions if isinstance(a, Stop)]


def report(spec: dict[str, Any], state: str = "ready", port: int = 20001, pid: int = 4242) -> dict[str, Any]:
    return {"spec": spec, "state": state, "port": port, "address": None,
            "process": {"pid": pid, "start_time": 1000 + pid, "boot_id": "boot-1"}, "adopted": False}


def make_ready(f: Fleet, now: float) -> None:
    for r in f.rec.book.replicas.values():
        for s in r.shards.values():
            if s.node_id and s.dispatched_at is not None and s.state in ("pending", "starting"):
                f.rec.observe_status(s.node_id, {"type": "shard_status", "shard_id": s.shard_id, "state": "ready",
                                                 "port": 20000 + s.rank + 1,
                                                 "process": {"pid": 100, "start_time": 1, "boot_id": "b"}}, now)


def no_double_claims(f: Fleet) -> None:
    assert f.rec.book.double_claims() == []
