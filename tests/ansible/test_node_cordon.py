"""llmgw.fleet.node_cordon through ansible-playbook against a real control plane, agents and engines.

Every state goes through check, apply, check, apply (changed, changed,
unchanged, unchanged); check mode sends nothing (the apply after it still
changes something); ``drained`` returns once the node holds no replica, its
replica Ready on the other node.  The module reads its one node
(``GET /v1/nodes/{node_id}``), never the fleet's list, as the control
plane's own request count shows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from fleet import Fleet, metric_samples  # noqa: E402
from fleet_harness import PLAYBOOKS, run_playbook  # noqa: E402

pytestmark = pytest.mark.integration

PLAY = PLAYBOOKS / "node_cordon.yml"
STATES = {"cordoned": "cordoned", "drained": "draining", "schedulable": None}


def admin_reads(f: Fleet) -> dict[str, float]:
    """GETs the control plane let through, by route template, from its own /metrics."""
    out = {"/v1/nodes": 0.0, "/v1/nodes/{node_id}": 0.0}
    for labels, value in metric_samples(f).get("llmgw_admin_requests_total", []):
        if labels["method"] == "GET" and labels["route"] in out:
            out[labels["route"]] = value
    return out


def test_cordon_drain_and_uncordon_with_check_mode_and_idempotence(tmp_path):
    with Fleet(tmp_path / "fleet", nodes={"a": 1, "b": 1}, replicas=1) as f:
        f.start()
        (ready,) = f.wait_ready(1)
        node = ready["shards"][0]["node_id"]
        other = next(n for n in f.node_ids.values() if n != node)
        conn = {"api_url": f.url, "ca_path": str(f.pki.ca_cert), "client_cert": str(f.pki.admin[0]),
                "client_key": str(f.pki.admin[1]), "node": node}

        before = admin_reads(f)
        run = run_playbook(PLAY, tmp_path / "drill", extravars={**conn, "states": list(STATES)})
        assert run.rc == 0, run.explain()
        after = admin_reads(f)
        # each task reads its one node (and polls it while draining), never the fleet's list
        assert after["/v1/nodes"] == before["/v1/nodes"], "node_cordon read the whole of GET /v1/nodes"
        assert after["/v1/nodes/{node_id}"] - before["/v1/nodes/{node_id}"] >= 4 * len(STATES)
        for state, want in STATES.items():
            drill = [run.task(f"{step} {state} ({n})")[0] for n in (1, 2) for step in ("Check", "Apply")]
            assert [r.changed for r in drill] == [True, True, False, False], (state, [r.res for r in drill])
            assert drill[0].res["diff"]["after"] == {"cordon": want}
            assert drill[0].res["was"] == drill[1].res["was"], "check mode changed something"
            assert drill[3].res["node"]["cordon"] == want
            if state == "drained":
                assert drill[1].res["node"]["drained"] is True
        (moved,) = f.wait_ready(1)
        assert moved["shards"][0]["node_id"] == other
        assert next(n for n in f.get("/v1/nodes")["nodes"] if n["node_id"] == node)["cordon"] is None

        bad = run_playbook(PLAY, tmp_path / "unknown", extravars={**conn, "node": "no-such-node", "states": ["cordoned"]})
        assert bad.rc != 0 and "no node 'no-such-node' has registered" in bad.stdout, bad.explain()
