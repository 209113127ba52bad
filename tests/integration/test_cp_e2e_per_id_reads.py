"""Per-id reads over mutual TLS against a real control plane, agents and engines, and ``ctl drain`` using them.

``GET /v1/nodes/{id}`` and ``GET /v1/replicas/{id}`` answer the very elements
of the lists, to an admin certificate only; an unknown id is a 404 naming it.
``ctl drain`` tells a node from a replica with them: the control plane's own
request count shows it never reads the fleet's list to do so.  The list
itself pages and filters, and refuses a bad query with a 400.
"""

from __future__ import annotations

from typing import Any

import pytest

from fleet import Fleet, metric_samples

pytestmark = pytest.mark.integration


def reads(f: Fleet) -> dict[str, float]:
    """GETs the control plane let through, by route template (its ``llmgw_admin_requests_total``)."""
    return {labels["route"]: value for labels, value in metric_samples(f).get("llmgw_admin_requests_total", [])
            if labels["method"] == "GET"}


def status_and_body(f: Fleet, path: str, **client: Any) -> tuple[int, Any]:
    with f.client(**client) as c:
        r = c.get(path)
        return r.status_code, r.json()


def test_per_id_reads_over_mtls_and_ctl_drain_reads_no_list(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1, "b": 1, "c": 1}, replicas=1) as f:
        f.start()
        (ready,) = f.wait_ready(1)
        rid, node = ready["replica_id"], ready["shards"][0]["node_id"]

        # the per-id answers are the list's elements (ages aside: they are read at another moment)
        listed = next(n for n in f.get("/v1/nodes")["nodes"] if n["node_id"] == node)
        one = f.get(f"/v1/nodes/{node}")
        assert one.keys() == listed.keys() and one["gpus"] == listed["gpus"] and one["hardware"] == listed["hardware"]
        replica = f.get(f"/v1/replicas/{rid}")
        assert replica["replica_id"] == rid and replica["state"] == "ready" and replica["shards"][0]["node_id"] == node

        # unknown ids: 404 naming the id; a node certificate is refused like everywhere on the admin API
        status, body = status_and_body(f, "/v1/nodes/no-such-node")
        assert status == 404 and "'no-such-node'" in body["error"]
        status, body = status_and_body(f, "/v1/replicas/no-such-replica")
        assert status == 404 and "'no-such-replica'" in body["error"]
        status, body = status_and_body(f, f"/v1/nodes/{node}", cert=f.pki.node(node))
        assert status == 403, body

        # the list in pages of one, and filtered; a bad query is a 400 naming what is wrong
        seen, after = [], None
        while True:
            page = f.get("/v1/nodes?limit=1" + (f"&after={after}" if after else ""))
            seen += [n["node_id"] for n in page["nodes"]]
            after = page["next"]
            if after is None:
                break
        assert seen == sorted(f.node_ids.values())
        assert f.get("/v1/nodes?state=lost")["nodes"] == []
        status, body = status_and_body(f, "/v1/nodes?limit=0")
        assert status == 400 and "limit must be a whole number" in body["error"]

        before = reads(f)
        assert "draining" in f.ctl("drain", rid).stdout
        assert "draining" in f.ctl("drain", node).stdout
        after_drains = reads(f)
        assert after_drains.get("/v1/nodes", 0) == before.get("/v1/nodes", 0), "ctl drain read the fleet's list"
        # the replica: not a node (404), a replica; the node: a node at the first read
        assert after_drains["/v1/nodes/{node_id}"] - before.get("/v1/nodes/{node_id}", 0) == 2
        assert after_drains["/v1/replicas/{replica_id}"] - before.get("/v1/replicas/{replica_id}", 0) == 1
        assert f.get(f"/v1/nodes/{node}")["cordon"] == "draining"

        bad = f.ctl("drain", "no-such-thing", check=False)
        assert bad.returncode == 1 and "'no-such-thing' is neither a registered node" in bad.stderr, bad.stderr
