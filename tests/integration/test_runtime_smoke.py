"""The runtime end to end on whatever interpreter runs the tests, and what it exports.

A control plane, a node agent and its engine, the control plane's own router and a
standalone ``llmgw router`` following the watch API, each its own process over
mutual TLS; the official ``openai`` client streams a completion through both
routers. This is what `make pythons` runs on the oldest Python the runtime supports,
where Ansible, hence the quickstart, cannot run.
"""

from __future__ import annotations

import openai
import pytest

from fleet import Fleet, until
from test_fleet_restart import router_endpoints, standalone_router

pytestmark = pytest.mark.integration

MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with Fleet(tmp_path_factory.mktemp("smoke"), nodes={"a": 2}, replicas=1, router=True) as f:
        f.start()
        [replica] = f.wait_ready(1)
        router, port = standalone_router(f)
        until(lambda: router_endpoints(port) == 1, "the standalone router to learn the replica",
              on_timeout=router.output)
        yield f, port, replica


def stream_text(base_url: str) -> str:
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60) as c:
        return "".join(ev.choices[0].delta.content or "" for ev in
                       c.chat.completions.create(model="tiny", messages=MSG, stream=True) if ev.choices)


def test_both_routers_stream_a_completion_from_the_agents_engine(live):
    f, port, _ = live
    for base in (f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{f.router_port}/v1"):
        assert stream_text(base).startswith("tok0")
    nodes = f.nodes()
    assert [n["state"] for n in nodes.values()] == ["ready"]
