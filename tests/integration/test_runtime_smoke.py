"""The runtime end to end on whatever interpreter runs the tests, and what it exports.

A control plane, a node agent and its engine, the control plane's own router and a
standalone ``llmgw router`` following the watch API, each its own process over
mutual TLS; the official ``openai`` client streams a completion through both
routers. This is what `make pythons` runs on the oldest Python the runtime supports,
where Ansible, hence the quickstart, cannot run. It is also what the collection's
Grafana dashboard is checked against: every series a panel queries must be declared
by one of these processes' live ``/metrics``.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from fleet import Fleet, until
from fleet import router_endpoints, standalone_router
from tests.support.dashboard import dashboard_metrics, promql_metrics, scrape

pytestmark = pytest.mark.integration

MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with Fleet(tmp_path_factory.mktemp("smoke"), nodes={"a": 2}, replicas=1, router=True, router_http=True) as f:
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


def test_promql_names_are_parsed_as_prometheus_sees_them():
    expr = ('histogram_quantile(0.99, sum by (le, model) (rate(llmgw_router_ttft_seconds_bucket{job="x"}[5m])))'
            ' / ignoring(state) sum without (node) (llmgw_node_gpus) + vllm:num_requests_running')
    assert promql_metrics(expr) == {"llmgw_router_ttft_seconds_bucket", "llmgw_node_gpus",
                                    "vllm:num_requests_running"}


def test_every_metric_the_dashboard_queries_is_exported(live):
    f, port, replica = live
    stream_text(f"http://127.0.0.1:{port}/v1")  # a stream: TTFT and inter-token samples exist
    with f.client() as c:
        exported = scrape(f.url + "/metrics", c)
    exported |= scrape(f"http://127.0.0.1:{port}/metrics")
    exported |= scrape(replica["endpoint"] + "/metrics")
    wanted = dashboard_metrics()
    assert len(wanted) >= 10
    missing = {name: sorted(panels) for name, panels in wanted.items() if name not in exported}
    assert missing == {}, f"dashboard queries metrics no process exports: {missing}"


STOP_GRACE = 20.0  # seconds a stopped process may take here (systemd's default is 90, the router's unit 45)


def test_sigterm_stops_the_agent_and_the_routers_within_their_grace(live):
    """The last test on the shared fleet: it stops the agent and the standalone router (the control
    plane and its own router are stopped by the next test's scenario, and by the fixture)."""
    import signal
    import subprocess

    f, _, _ = live
    procs = [*f.extra, *f.agents.values()]
    assert len(procs) == 2
    for p in procs:
        p.signal(signal.SIGTERM)
    for p in procs:
        try:
            p.proc.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{p.name} ran on {STOP_GRACE:g}s after SIGTERM:\n{p.output(4000)}")
    f.server.signal(signal.SIGTERM)
    try:
        f.server.proc.wait(STOP_GRACE)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the control plane ran on {STOP_GRACE:g}s after SIGTERM:\n{f.server.output(4000)}")


def test_sigterm_stops_a_control_plane_while_agents_register(tmp_path):
    """Before 3.12 ``asyncio.wait_for`` could lose the cancellation SIGTERM starts (CPython gh-86296),
    and a control plane kicked by every registration then ran on, deaf to SIGTERM. Three stops, each in
    the middle of a registration storm of simulated agents that keep dialling."""
    import signal
    import subprocess
    import sys

    from fleet import Proc

    with Fleet(tmp_path, nodes={}, replicas=0) as f:
        status = tmp_path / "sim-status.json"
        argv = [sys.executable, "-m", "llmgw.sim.fleet.cli", "--url", f.stream_url,
                "--ca-dir", str(f.pki.ca.directory), "--cert-cache", str(tmp_path / "certs"), "--nodes", "60",
                "--prefix", f"st{f.suffix.replace('-', '')}", "--reconnect-initial", "0.05",
                "--reconnect-max", "0.2", "--status-file", str(status), "--status-interval", "0.2"]
        sim = Proc("fleet-sim", argv, tmp_path / "sim.log", tmp_path)
        f.extra.append(sim)
        for life in range(3):
            f.start(agents=False)
            if life == 0:
                sim.start()
            registered = f"registered (epoch"
            until(lambda: f.server.life_output().count(registered) >= 5, "agents registering", on_timeout=f.dump)
            f.server.signal(signal.SIGTERM)
            try:
                f.server.proc.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the control plane ran on {STOP_GRACE:g}s after SIGTERM:\n{f.server.output(4000)}")
            assert f.server.proc.returncode == 0, f.server.output(4000)


def _ignores_hangup(pid: int) -> bool:
    """SIGHUP (signal 1) in the process's ignored set, as /proc/PID/status shows it."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigIgn:"):
                return bool(int(line.split()[1], 16) & 1)
    except OSError:
        pass
    return False


def test_a_reload_while_a_daemon_is_still_starting_does_not_end_it(tmp_path):
    """`systemctl restart` then at once `systemctl reload` (the roles did both after a key rotation):
    the SIGHUP reached a router while it was still importing, before it handled SIGHUP, and ended it.
    Sent inside that window (while SIGHUP is ignored, before the reload handler replaces that), the
    control plane lives on and serves."""
    import signal

    with Fleet(tmp_path, nodes={}, replicas=0) as f:
        f.server.start()
        until(lambda: _ignores_hangup(f.server.pid) or not f.server.alive(),
              "the starting control plane to ignore SIGHUP until it handles it", interval=0.005)
        f.server.signal(signal.SIGHUP)
        f.wait_healthy()
        assert f.server.alive(), f.server.output(3000)
