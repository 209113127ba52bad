"""Engine traffic on the node network: bound to the fleet address, and over TLS where the engine can.

Real control plane, agent, engine simulator (vLLM's ``--ssl-keyfile``/``--ssl-certfile``)
and routers.  An engine listens on the node's advertise_address only, so another
address of the same host does not reach it (127.0.0.2 next to 127.0.0.1 on
loopback).  With an engine certificate in agent.yaml the engine serves HTTPS,
the agent's readiness probe and liveness checks verify it against the fleet CA,
the control plane hands routers an https:// endpoint, and a router that trusts
another CA refuses the engine instead of sending it a prompt and its key.
"""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import httpx
import pytest

from fleet import Fleet, edit_agent_config, router_endpoints, standalone_router, until
from llmgw.tls import init_ca
from llmgw.tls.files import write_pair
from llmgw.tls.issue import issue_engine

pytestmark = pytest.mark.integration

BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


def rank0(f: Fleet) -> tuple[dict, dict]:
    (replica,) = f.ready_replicas()
    return replica, next(s for s in replica["shards"] if s["rank"] == 0)


def connects(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError:
        return False
    return True


def completion(url: str, ca: Path) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=BODY, timeout=30,
                      verify=ssl.create_default_context(cafile=str(ca)))


def served(url: str, ca: Path) -> bool:
    try:
        return completion(url, ca).status_code == 200
    except httpx.HTTPError:  # the router is not listening yet
        return False


def test_engine_binds_the_fleet_address_not_every_interface(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1) as f:
        # agent.yaml as an operator writes it: an advertise_address, no engine_bind_host
        edit_agent_config(f.agents["a"], lambda doc: doc.pop("engine_bind_host"))
        f.start()
        f.wait_ready(1)
        _, shard = rank0(f)
        assert connects("127.0.0.1", shard["port"])
        assert not connects("127.0.0.2", shard["port"]), "the engine listens on an address it was not given"


def test_replica_serves_tls_that_routers_verify_against_the_fleet_ca(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1, router=True) as f:
        crt, key = write_pair(tmp_path / "engine-a", *issue_engine(f.pki.ca, [], ["127.0.0.1"]))
        edit_agent_config(f.agents["a"], lambda doc: doc.update(engine_tls={"cert": str(crt), "key": str(key)}))
        f.start()
        f.wait_ready(1)  # Ready: the agent's probe completed a token over verified TLS
        replica, shard = rank0(f)
        assert replica["endpoint"] == f"https://127.0.0.1:{shard['port']}"
        assert (replica["clear_text"], shard["scheme"]) == (False, "https")
        assert "https://" in f.ctl("replicas").stdout

        # The engine speaks TLS only, with the node's engine certificate of the fleet CA.
        engine = f"https://127.0.0.1:{shard['port']}"
        assert httpx.get(f"{engine}/health", timeout=30,
                         verify=ssl.create_default_context(cafile=str(f.pki.ca_cert))).status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{shard['port']}/health", timeout=10).raise_for_status()

        # The in-process router (the control plane's tls.ca) and a standalone one (control_plane.ca).
        r = completion(f.router_url, f.pki.ca_cert)
        assert r.status_code == 200 and r.json()["choices"], r.text
        router, port = standalone_router(f)
        until(lambda: served(f"http://127.0.0.1:{port}", f.pki.ca_cert),
              "the standalone router to serve over TLS to the engine", on_timeout=router.output)

        # A router that trusts another CA refuses the engine: no prompt, no engine key sent.
        other = init_ca(tmp_path / "other-ca")
        wrong, wport = standalone_router(f, name="wrong-ca", extra={"engine_ca": str(other.cert_path)})
        until(lambda: router_endpoints(wport), "the router with the wrong CA to learn the endpoint",
              on_timeout=wrong.output)
        r = completion(f"http://127.0.0.1:{wport}", f.pki.ca_cert)
        assert r.status_code == 502, r.text
        # the reason is in the client's error body or, where bodies are generic, in the router's log
        reason = "TLS handshake failed: certificate verify failed"
        assert reason in r.text or reason in wrong.output(), (r.text, wrong.output())

        # After an agent restart the adopted engine is still checked over TLS and still https.
        f.agents["a"].kill()
        f.agents["a"].start()
        until(lambda: "adopted pid" in f.agents["a"].life_output(), "the restarted agent to adopt the engine",
              on_timeout=f.agents["a"].output)
        _, again = rank0(f)
        assert (again["process"]["pid"], again["scheme"]) == (shard["process"]["pid"], "https")
