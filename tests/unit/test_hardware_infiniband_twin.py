"""The collection's sysfs reader (``hca_validate``, at rollout) reads what the agent's reads.

The collection's ``module_utils/infiniband.py`` must stay self-contained (it
runs where llmgw is not installed), so it parses InfiniBand sysfs itself;
the fabric rules are one file in two homes, and this holds the two readers
to the same answer over every recorded sysfs tree: a format only one of
them understands would make rollout and the agent disagree about a port.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.hardware.infiniband import read_hcas

ROOT = Path(__file__).resolve().parents[2]
SYSFS = ROOT / "tests" / "fixtures" / "sysfs"
COLLECTIONS = ROOT / "collections"
TREES = sorted(p.name for p in SYSFS.iterdir() if (p / "class" / "infiniband").is_dir())

READ = """
import json, sys
from ansible_collections.llmgw.fleet.plugins.module_utils.infiniband import read_adapters
print(json.dumps({root: read_adapters(root) for root in sys.argv[1:]}))
"""


@pytest.fixture(scope="module")
def collection_reads() -> dict:
    """The collection's reader, imported as Ansible imports it (from the collections path), in its own process."""
    roots = [str(SYSFS / t / "class" / "infiniband") for t in TREES]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(COLLECTIONS), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", READ, *roots], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def agent_read(root: Path) -> list[dict]:
    """The agent's reading, in the collection's shape (the fields both read)."""
    out = []
    for h in read_hcas(root):
        out.append({"name": h.name, "node_guid": h.node_guid, "pci_bus_id": h.pci_bus_id, "ports": [
            {"port": p.port, "state": p.state, "phys_state": p.phys_state, "rate_gbps": p.rate_gbps,
             "rate_text": p.rate_text, "link_layer": p.link_layer, "reason": p.reason, "gid_index": p.gid_index}
            for p in h.ports]})
    return out


def test_there_are_trees_to_compare():
    assert {"healthy", "malformed", "roce_gid", "dualport", "vf_zero_guid"} <= set(TREES)


@pytest.mark.parametrize("tree", TREES)
def test_both_readers_read_the_same_adapters(collection_reads, tree):
    root = SYSFS / tree / "class" / "infiniband"
    assert collection_reads[str(root)] == agent_read(root)
