"""llmgw.fleet.node_cordon through ansible-playbook against a real control plane, agents and engines.

Every state goes through check, apply, check, apply (changed, changed,
unchanged, unchanged); check mode sends nothing (the control plane's view is
unchanged after it); ``drained`` returns once the node holds no replica, its
replica Ready on the other node.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from fleet import Fleet  # noqa: E402
from fleet_harness import PLAYBOOKS, four_runs, run_playbook  # noqa: E402

pytestmark = pytest.mark.integration

PLAY = PLAYBOOKS / "node_cordon.yml"


def cordon_of(f: Fleet, node: str):
    return next(n for n in f.get("/v1/nodes")["nodes"] if n["node_id"] == node)["cordon"]


def test_cordon_drain_and_uncordon_with_check_mode_and_idempotence(tmp_path):
    with Fleet(tmp_path / "fleet", nodes={"a": 1, "b": 1}, replicas=1) as f:
        f.start()
        (ready,) = f.wait_ready(1)
        node = ready["shards"][0]["node_id"]
        other = next(n for n in f.node_ids.values() if n != node)
        conn = {"api_url": f.url, "ca_path": str(f.pki.ca_cert), "client_cert": str(f.pki.admin[0]),
                "client_key": str(f.pki.admin[1]), "node": node}

        for state, want in (("cordoned", "cordoned"), ("drained", "draining"), ("schedulable", None)):
            runs = four_runs(PLAY, tmp_path / state, extravars={**conn, "node_state": state})
            for r in runs:
                assert r.rc == 0, r.explain()
            assert [r.changed() for r in runs] == [1, 1, 0, 0], [r.explain() for r in runs]
            (check,) = runs[0].task("Set the cordon")
            assert check.res["diff"]["after"] == {"cordon": want}
            assert cordon_of(f, node) == want
            if state == "drained":
                (applied,) = runs[1].task("Set the cordon")
                assert applied.res["node"]["drained"] is True
                (moved,) = f.wait_ready(1)
                assert moved["shards"][0]["node_id"] == other

        bad = run_playbook(PLAY, tmp_path / "unknown", extravars={**conn, "node": "no-such-node",
                                                                   "node_state": "cordoned"})
        assert bad.rc != 0 and "no node 'no-such-node' has registered" in bad.stdout, bad.explain()
