"""Generated hostile messages on the agent stream hurt only their sender (bounded examples).

The longer run is ``python benchmarks/chaos/run.py --fuzz-examples N``; the
generators and the invariants are in ``streamfuzz.py``.
"""

from __future__ import annotations

import pytest

from streamfuzz import KINDS, fuzz_fleet

pytestmark = pytest.mark.integration

EXAMPLES = 120  # derandomized: the same inputs on every run, every kind among them


def test_hostile_agent_messages_close_only_their_own_stream(tmp_path):
    r = fuzz_fleet(tmp_path, EXAMPLES, derandomize=True)  # fails at the first stream the server leaves open
    assert r["examples"] == EXAMPLES and r["not_closed"] == []
    assert set(r["by_kind"]) == set(KINDS), f"every kind of input was tried: {r['by_kind']}"
    assert r["bystander_reregistrations"] == 0 and r["bystander_connected"], \
        "the real agent kept its one registration and its stream"
    assert r["router_failed"] == 0 and r["router_ok"] > 0, r["router_failures"]
    assert r["server_tracebacks"] == 0, r["traceback_lines"]
    assert r["fleet_alive"]
