"""Downloads in a real fleet: control plane, agent and engines as processes, read back with ``llmgw ctl``."""

from __future__ import annotations

import hashlib
import random
import re

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from fleet import Fleet, until
from fetch_support import WeightsServer

pytestmark = pytest.mark.integration

MIB = 1 << 20


def shards_fetching(f: Fleet) -> float:
    """``llmgw_node_shards_fetching`` summed over the nodes, from the control plane's /metrics."""
    with f.client() as c:
        text = c.get("/metrics").raise_for_status().text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "llmgw_node_shards_fetching")


def test_progress_shows_under_the_replica_then_clears_and_a_bad_digest_fails_with_both_digests(tmp_path):
    data = random.Random(13).randbytes(4 * MIB)
    good = hashlib.sha256(data).hexdigest()
    wrong = hashlib.sha256(b"something else").hexdigest()
    with WeightsServer() as srv, Fleet(tmp_path, nodes={"a": 2}, replicas=1) as f:
        srv.add("org/tiny/model.safetensors", data, trickle=(128 << 10, 0.15))  # ~5 s: long enough to be seen
        srv.add("org/bad/model.safetensors", data)
        f.config["models"] = [
            {"name": "tiny", "source": srv.url("org/tiny/model.safetensors"), "sha256": good},
            {"name": "bad", "source": srv.url("org/bad/model.safetensors"), "sha256": wrong},
        ]
        f.config["deployments"].append({"model": "bad", "profile": "sim", "replicas": 1})
        f.write_config()
        agent_yaml = tmp_path / "a" / "agent.yaml"
        cfg = yaml.safe_load(agent_yaml.read_text())
        cfg["fetch"] = {"progress_interval": 0.2, "attempts": 1}
        agent_yaml.write_text(yaml.safe_dump(cfg))
        f.start()

        # what a dashboard shows as downloads in progress: the shard fetching its weights
        until(lambda: shards_fetching(f) == 1, "llmgw_node_shards_fetching to count the download",
              on_timeout=f.dump)
        line = re.compile(r"^ {6}downloading model\.safetensors  \d+\.\d (KiB|MiB) / 4\.0 MiB  \d+%  \d+(\.\d)? "
                          r"(KiB|MiB)/s  ETA \d+(s|m\d\ds)$", re.M)
        shown = until(lambda: line.search(f.ctl("replicas").stdout), "a progress line under the fetching replica",
                      on_timeout=f.dump)
        assert shown
        listing = f.ctl("replicas").stdout
        assert "fetching" in listing or "starting" in listing

        (ready,) = f.wait_ready(1)
        assert ready["model"] == "tiny" and ready["shards"][0]["progress"] is None
        assert "downloading" not in f.ctl("replicas").stdout  # a serving shard never shows a stale 99%
        assert srv.files["org/tiny/model.safetensors"].gets == 1
        until(lambda: shards_fetching(f) == 0, "llmgw_node_shards_fetching back to 0", on_timeout=f.dump)

        reason = until(lambda: next((s.get("reason") for r in f.replicas()["replicas"] if r["model"] == "bad"
                                     for s in r["shards"] if s["state"] == "failed"), None),
                       "the bad digest to fail its shard", on_timeout=f.dump)
        assert f"sha256 mismatch: expected {wrong}, got {good}" in reason
        assert f"sha256 mismatch: expected {wrong}" in f.ctl("replicas").stdout
