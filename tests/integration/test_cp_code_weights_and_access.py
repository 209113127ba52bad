"""Real processes: weights too big for the fleet are never launched, and an insecure API is never open.

The weights are a sparse file served by a plain HTTP server: its
Content-Length is larger than any simulated GPU, without using the disk.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import os
import signal
import subprocess
import threading

import httpx
import pytest
import yaml

from fleet import GIB, Fleet, Proc, free_port, llmgw_argv, until

pytestmark = pytest.mark.integration

SIZE = 100 * GIB  # the fleet's GPUs have 80 GiB each


class QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def weights_url(tmp_path):
    www = tmp_path / "www"
    www.mkdir()
    with open(www / "big.gguf", "wb") as fh:
        fh.truncate(SIZE)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietFiles, directory=str(www)))
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/big.gguf"
    srv.shutdown()
    srv.server_close()


def test_url_weights_larger_than_gpu_memory_are_not_placed_and_explain_says_why(tmp_path, weights_url):
    with Fleet(tmp_path / "fleet", nodes={"a": 1}, replicas=1) as f:
        f.config["models"] = [{"name": "tiny", "source": weights_url}]
        f.write_config()
        f.start()
        until(lambda: f.node_ids["a"] in {n["node_id"] for n in (f.try_get("/v1/nodes") or {}).get("nodes", [])},
              "the agent to register", on_timeout=f.dump)

        def refused():
            doc = f.try_get("/v1/replicas")
            reasons = [u["reason"] for u in (doc or {}).get("unplaced", [])]
            return next((r for r in reasons if "GPU memory too small" in r), None)
        until(refused, "tiny/sim#0 to be refused for memory", on_timeout=f.dump)

        doc = f.get("/v1/explain/tiny")
        (item,) = doc["replicas"]
        assert item["placed"] is False and item["weights"] == {"bytes": SIZE, "source": "measured from URL"}
        assert "GPU memory too small: needs 120.0 GiB (weights 100.0 GiB + 20% headroom)" in item["text"]

        res = f.ctl("explain", "tiny", check=False)
        assert res.returncode == 3, res.stdout + res.stderr
        assert "GPU memory too small" in res.stdout
        assert "weights: 100.0 GiB (measured from URL)" in res.stdout

        catalog = f.get("/v1/catalog")
        assert catalog["models"][0]["weights"] == {"bytes": SIZE, "source": "measured from URL"}
        assert f.replicas()["replicas"] == []
        assert f.engine_pids() == []
        log = f.server.output(10**7)
        assert f"model tiny: weights at {weights_url} are {SIZE} bytes (measured from URL)" in log
        assert "placed (" not in log
        assert "fetch" not in f.agents["a"].output(10**7).lower()


def test_insecure_server_without_admin_tokens_is_closed_until_tokens_are_configured(tmp_path):
    port = free_port()
    token = "integration-admin-token-0123456789"
    doc = {"api": {"listen": {"host": "127.0.0.1", "port": port}}, "insecure_no_tls": True,
           "models": [], "profiles": [], "deployments": []}
    cfg = tmp_path / "server.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    server = Proc("insecure server", llmgw_argv("server", "--config", str(cfg)), tmp_path / "server.log",
                  tmp_path).start()
    base = f"http://127.0.0.1:{port}"

    def status(path: str, headers: dict[str, str] | None = None) -> int | None:
        assert server.alive(), server.output()
        try:
            return httpx.get(base + path, headers=headers or {}, timeout=30).status_code
        except httpx.TransportError:
            return None

    try:
        until(lambda: status("/healthz") == 200, "the insecure server to answer", on_timeout=server.output)
        bearer = {"Authorization": f"Bearer {token}"}
        for path in ("/v1/nodes", "/v1/replicas", "/v1/catalog", "/metrics"):
            r = httpx.get(base + path, headers=bearer, timeout=30)
            assert r.status_code == 401, (path, r.text)
            assert "api.admin_tokens" in r.json()["error"]
        assert httpx.post(base + "/v1/reload", timeout=30).status_code == 401
        assert "admin API is CLOSED" in server.output()

        ctl = subprocess.run([*llmgw_argv("ctl", "nodes"), "--url", base, "--token", token], capture_output=True,
                             text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert ctl.returncode == 1 and "HTTP 401" in ctl.stderr and "api.admin_tokens" in ctl.stderr

        doc["api"]["admin_tokens"] = [{"name": "ops", "sha256": hashlib.sha256(token.encode()).hexdigest()}]
        cfg.write_text(yaml.safe_dump(doc))
        os.kill(server.pid, signal.SIGHUP)
        until(lambda: status("/v1/nodes", bearer) == 200, "the reloaded tokens to open the API",
              on_timeout=server.output)
        assert status("/v1/nodes") == 401
        assert status("/v1/nodes", {"Authorization": "Bearer nope"}) == 403
    finally:
        server.terminate()
