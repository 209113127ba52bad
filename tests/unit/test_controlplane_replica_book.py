"""The replica book's node index answers "what runs on this node" as a walk of the fleet would."""

from __future__ import annotations

from llmgw.controlplane.replicas import Replica, ReplicaBook, Shard, shard_id


def replica(rid: str, *nodes: str) -> Replica:
    shards = {rank: Shard(shard_id(rid, rank), rid, rank, node, (0,), {}) for rank, node in enumerate(nodes)}
    return Replica(rid, "m", "p", len(nodes), 0, shards, created_at=0.0)


def walked(book: ReplicaBook, node_id: str) -> set[str]:
    return {r.replica_id for r in book.replicas.values() if node_id in r.nodes()}


def test_replicas_on_a_node_follow_adds_moves_and_removals_and_leave_strays_out():
    book = ReplicaBook()
    book.add(replica("a", "n1"))
    book.add(replica("b", "n1", "n2"))  # two nodes, one replica
    book.add(replica("c", "n3"))
    book.add_stray(Shard("x/r0", "x", 0, "n1", (1,), {}))
    assert book.replica_ids_on("n1") == walked(book, "n1") == {"a", "b"}
    assert book.replica_ids_on("n2") == walked(book, "n2") == {"b"}
    # rank 1 of b replaced on another node
    book.set_shard(book.replicas["b"], 1, Shard(shard_id("b", 1), "b", 1, "n3", (0,), {}))
    assert book.replica_ids_on("n2") == walked(book, "n2") == set()
    assert book.replica_ids_on("n3") == walked(book, "n3") == {"b", "c"}
    book.remove("a")
    assert book.replica_ids_on("n1") == walked(book, "n1") == {"b"}
    assert book.replica_ids_on("unknown") == set()
