"""A router's port is its own: a port another process holds fails the start, and nothing joins it.

Router workers bind with SO_REUSEPORT so the kernel spreads clients over them; any other
process of the same user that sets it too (vLLM does) could bind the same port and take a
share of the clients silently. Seen in a test run: an engine started on a port another
listener held, and every request meant for one went to the other.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import yaml

from router_support import HOST, RouterProcess, router_doc

pytestmark = pytest.mark.integration

ENDPOINTS = [{"model": "m", "url": "http://127.0.0.1:9"}]


def reuseport_listener(port: int = 0) -> socket.socket:
    """A listener bound as vLLM binds its API port."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((HOST, port))
    s.listen(8)
    return s


@pytest.mark.parametrize("workers", [1, 2])
def test_a_port_another_process_holds_fails_the_start_naming_it(tmp_path, workers):
    with reuseport_listener() as held:
        port = held.getsockname()[1]
        cfg = tmp_path / "router.yaml"
        cfg.write_text(yaml.safe_dump({"listen": {"host": HOST, "port": port}, **router_doc(ENDPOINTS)}))
        r = subprocess.run([sys.executable, "-m", "llmgw.router", "--config", str(cfg), "--workers", str(workers)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"cannot listen on {HOST}:{port}: another process holds the port" in r.stderr, r.stderr


def test_nothing_joins_a_single_workers_port_later(tmp_path):
    with RouterProcess(router_doc(ENDPOINTS), workers=1, tmp=tmp_path) as router:
        with pytest.raises(OSError) as e:
            reuseport_listener(router.port).close()
        assert e.value.errno == 98  # EADDRINUSE
        assert router.get("/healthz")  # still the router's
