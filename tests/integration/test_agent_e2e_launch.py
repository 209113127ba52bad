"""A shard the node cannot launch fails before any engine starts, and says why, through real processes.

The control plane cannot know what is on a node's disk: a catalog model
whose local path does not exist there passes every server-side check, is
placed, and reaches the agent as a start.  The agent's preflight must refuse
it with a reason the operator sees in ``llmgw ctl replicas``, and must not
have started an engine to find out (an engine that loads for minutes before
failing on the path is the failure this check exists to prevent).
"""

from __future__ import annotations

import json
import os

import pytest
import yaml

from llmgw.agent.statedir import StateDir

from fleet import Fleet, until

pytestmark = pytest.mark.integration


def test_a_model_path_missing_on_the_node_fails_the_shard_with_its_reason_and_no_engine_starts(tmp_path):
    missing = tmp_path / "no-such-weights" / "tiny"
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1, restart={"backoff_initial": 300, "backoff_max": 300}) as f:
        f.config["models"] = [{"name": "tiny", "source": str(missing)}]
        f.write_config()
        launched = tmp_path / "engine-was-run"
        wrapper = tmp_path / "engine-recording-its-launch"
        wrapper.write_text(f"#!/bin/sh\necho \"$$ $*\" >> {launched}\nexec {f.sim} \"$@\"\n")
        wrapper.chmod(0o755)
        agent_yaml = tmp_path / "a" / "agent.yaml"
        doc = yaml.safe_load(agent_yaml.read_text())
        doc["engines"] = {"vllm": [str(wrapper)]}
        agent_yaml.write_text(yaml.safe_dump(doc))
        f.start()
        agent = f.agents["a"]
        why = f"model 'tiny': model path {missing} does not exist"

        def failed():
            doc = f.try_get("/v1/replicas")
            return next((r for r in (doc or {}).get("replicas", ()) if r["state"] == "failed"), None)

        r = until(failed, "a failed replica in the API", on_timeout=f.dump)
        (s,) = r["shards"]
        assert s["node_id"] == f.node_ids["a"] and s["state"] == "failed"
        assert why in s["reason"]
        assert s["process"] is None and s["pid"] is None, "no engine process behind the failed shard"

        table = f.ctl("replicas").stdout
        row = next(line for line in table.splitlines() if line.startswith(r["replica_id"]))
        assert row.split()[1:3] == ["tiny/sim", "failed"], table
        assert why in table and "next attempt in" in table, table
        as_json = json.loads(f.ctl("replicas", "-o", "json").stdout)
        reasons = [sh["reason"] or "" for rep in as_json["replicas"] for sh in rep["shards"]]
        assert any(why in x for x in reasons), reasons

        assert not launched.exists(), f"an engine was started: {launched.read_text()}"
        assert f.engine_pids() == []
        assert StateDir(tmp_path / "a" / "state").load() == ([], [])
        logs = tmp_path / "a" / "state" / "logs"
        assert not logs.exists() or list(logs.iterdir()) == [], "no engine log was even opened"
        assert agent.output(10**7).count(why) == 1
        assert agent.alive() and f.nodes()[f.node_ids["a"]]["state"] == "ready"
        assert not any(str(missing) in " ".join(p) for p in _cmdlines()), "nothing runs with that path"


def _cmdlines() -> list[list[str]]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    out.append([a.decode(errors="replace") for a in fh.read().split(b"\0") if a])
            except OSError:
                pass
    return out
