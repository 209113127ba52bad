"""Generated hostile messages on the agent stream hurt only their sender (bounded examples).

The longer run is ``python benchmarks/chaos/run.py --fuzz-examples N``; the
generators and the invariants are in ``streamfuzz.py``.
"""

from __future__ import annotations

import pytest

from fleet import Fleet, until
from streamfuzz import KINDS, RouterLoad, fleet_health, run_cases, tracebacks

pytestmark = pytest.mark.integration

EXAMPLES = 120  # derandomized: the same inputs on every run, every kind among them


def test_hostile_agent_messages_close_only_their_own_stream(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1, router=True,
               lifecycle={"unreachable_after": 30, "lost_after": 60}) as f:
        f.start()
        f.wait_ready(1)
        before = fleet_health(f)
        with RouterLoad(f"http://127.0.0.1:{f.router_port}") as load:
            until(lambda: load.ok >= 3, "router requests before fuzzing")
            res = run_cases(f, EXAMPLES, derandomize=True)  # asserts each stream was closed by the server
            after = fleet_health(f)
            ok = load.ok
            until(lambda: load.ok > ok, "router requests after fuzzing")
        assert res.not_closed == []
        assert set(res.by_kind) == set(KINDS), f"every kind of input was tried: {res.by_kind}"
        assert after == before, "the real agent kept its one registration and its stream"
        assert load.failed == [], load.failed[:5]
        assert tracebacks(f.server.output(10 ** 9)) == [], "no exception escaped a handler"
        assert f.server.alive() and f.agents["a"].alive()
        (rep,) = f.wait_ready(1)
        assert f.nodes()[f"fuzz-{f.suffix}"]["connected"] is False
