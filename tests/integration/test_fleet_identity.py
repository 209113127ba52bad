"""Who may talk to a real ``llmgw server`` process, over real mutual TLS.

One control plane serves the whole module; the clients are written here so
each can present exactly the certificate a test needs (wrong CN, wrong CA,
expired, wrong usage, none) and see exactly what the server answers.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import signal
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from llmgw.tls import init_ca, issue_node, issue_server
from llmgw.tls.ca import generate_key, key_to_pem, utcnow
from llmgw.tls.context import client_context
from llmgw.tls.files import write_pair
from llmgw.tls.issue import LeafRequest, build_leaf

from fleet import ADMIN_TOKEN, Fleet, make_pki, register_message, self_signed_node, until

pytestmark = pytest.mark.integration

STREAM = "/v1/agent/stream"


@pytest.fixture(scope="module")
def cp(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("identity"), nodes={}, replicas=0,
              lifecycle={"unreachable_after": 30, "lost_after": 60})
    f.start()
    yield f
    f.close()


def register(node_id: str) -> dict[str, Any]:
    return register_message(node_id, gpus=2)


def write(path: Path, cert: bytes, key: bytes) -> tuple[Path, Path]:
    return write_pair(path, cert, key)


def leaf(cp: Fleet, role: str, name: str, **kw: Any) -> tuple[bytes, bytes]:
    """A certificate from the fleet CA with any CN (bypassing issuing's id rules)."""
    key = generate_key()
    cert = build_leaf(cp.pki.ca, LeafRequest(role=role, name=name), key.public_key(), **kw)
    return cert.public_bytes(serialization.Encoding.PEM), key_to_pem(key)


async def _stream(cp: Fleet, cert: tuple[Path, Path] | None, first: dict[str, Any] | None,
                  then: list[Any] = (), hold: bool = False) -> dict[str, Any]:
    """Connect, send ``first`` and ``then``; report what the server did."""
    ctx = client_context(cp.pki.ca_cert, *cert) if cert else client_context(cp.pki.ca_cert)
    out: dict[str, Any] = {"received": []}
    try:
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(cp.url.replace("https", "wss") + STREAM, ssl=ctx, max_msg_size=8 << 20) as ws:
                if first is not None:
                    await ws.send_str(json.dumps(first))
                    msg = await ws.receive(timeout=60)
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        out["received"].append(json.loads(msg.data))
                for item in then:
                    await ws.send_str(item if isinstance(item, str) else json.dumps(item))


                async def drain() -> None:
                    while True:
                        msg = await ws.receive()
                        if msg.type != aiohttp.WSMsgType.TEXT:
                            return
                        out["received"].append(json.loads(msg.data))

                # One deadline for the whole wait: keepalive pings would restart
                # a per-receive timeout forever.
                await asyncio.wait_for(drain(), timeout=3 if hold else 60)
                out["close_code"] = ws.close_code
    except aiohttp.WSServerHandshakeError as e:
        out["http_status"] = e.status
    except asyncio.TimeoutError:
        out["still_open"] = True
    except (aiohttp.ClientError, OSError) as e:  # the TLS handshake refused us
        out["connection_error"] = f"{type(e).__name__}: {e}"
    return out


def stream(cp: Fleet, cert, first, then=(), hold=False) -> dict[str, Any]:
    return asyncio.run(_stream(cp, cert, first, list(then), hold))


def kinds(res: dict[str, Any]) -> list[str]:
    return [m["type"] for m in res["received"]]


def known_nodes(cp: Fleet) -> set[str]:
    return set(cp.nodes())


def test_registration_with_a_matching_node_certificate_is_accepted(cp, tmp_path):
    cert = cp.pki.node("good-node")
    res = stream(cp, cert, register("good-node"), hold=True)
    assert kinds(res)[:1] == ["registered"], res
    assert res["received"][0]["epoch"] >= 1
    assert "good-node" in known_nodes(cp)
    # The API shows the certificate the agent presented, for expiry checks on what is in use.
    presented = x509.load_pem_x509_certificate(Path(cert[0]).read_bytes())
    shown = cp.nodes()["good-node"]["certificate"]
    assert shown["serial"] == format(presented.serial_number, "x")
    assert dt.datetime.fromisoformat(shown["not_after"]) == presented.not_valid_after_utc
    assert shown["fingerprint_sha256"].replace(":", "").lower() == presented.fingerprint(hashes.SHA256()).hex()


@pytest.mark.parametrize("cert_cn, claimed", [
    ("NODE-CASE", "node-case"),  # case variants, both ways
    ("node-case2", "Node-Case2"),
    ("node-dot.", "node-dot"),  # trailing dot, both ways
    ("node-dot2", "node-dot2."),
])
def test_cn_differing_from_claimed_node_id_is_refused_every_time(cp, tmp_path, cert_cn, claimed):
    cert = write(tmp_path / "c", *leaf(cp, "node", cert_cn))
    for attempt in range(2):
        res = stream(cp, cert, register(claimed))
        assert kinds(res) == ["error"], res
        assert "does not match" in res["received"][0]["reason"]
        assert res["close_code"] == 1008
    assert claimed not in known_nodes(cp) and cert_cn not in known_nodes(cp)
    until(lambda: f"claiming {claimed!r}: certificate CN {cert_cn!r} does not match" in cp.server.output(10**7),
          "the refusal and its reason in the server log", on_timeout=cp.server.output)


def test_another_valid_nodes_certificate_cannot_register_as_this_node(cp):
    other = cp.pki.node("node-other")
    for attempt in range(3):
        res = stream(cp, other, register("node-victim"))
        assert kinds(res) == ["error"] and "does not match" in res["received"][0]["reason"], res
    assert "node-victim" not in known_nodes(cp)


def test_admin_certificate_cannot_register_as_a_node(cp):
    res = stream(cp, cp.pki.admin, register("operator"))
    assert res.get("http_status") == 403, res
    assert "operator" not in known_nodes(cp)
    assert "certificate role 'admin' cannot register as a node" in cp.server.output(10**7)


def test_foreign_expired_wrong_usage_and_missing_certificates_are_refused(cp, tmp_path):
    other_ca = init_ca(tmp_path / "other-ca")
    cases = {
        "self-signed": write(tmp_path / "self", *self_signed_node("node-ss")),
        "other-ca": write(tmp_path / "other", *issue_node(other_ca, "node-ss")),
        "expired": write(tmp_path / "expired", *issue_node(cp.pki.ca, "node-ss", days=1,
                                                           now=utcnow() - dt.timedelta(days=3))),
        "serverAuth-only": write(tmp_path / "server", *issue_server(cp.pki.ca, ["node-ss"], ["127.0.0.1"])),
        "no-certificate": None,
    }
    for what, cert in cases.items():
        res = stream(cp, cert, register("node-ss"))
        assert "registered" not in kinds(res), (what, res)
        if what == "no-certificate":
            assert res.get("http_status") == 403, res
        else:  # refused in the handshake: no HTTP exchange at all
            assert "connection_error" in res or res.get("http_status") == 403, (what, res)
    assert "node-ss" not in known_nodes(cp)
    assert "the peer presented no certificate" in cp.server.output(10**7)


def test_malformed_or_oversized_message_closes_only_its_senders_stream(cp):
    bystander = cp.pki.node("node-bystander")
    sender = cp.pki.node("node-sender")

    async def scenario() -> dict[str, Any]:
        ctx_b = client_context(cp.pki.ca_cert, *bystander)
        results: dict[str, Any] = {}
        async with aiohttp.ClientSession() as s:
            url = cp.url.replace("https", "wss") + STREAM
            async with s.ws_connect(url, ssl=ctx_b) as wb:
                await wb.send_str(json.dumps(register("node-bystander")))
                reg = json.loads((await wb.receive(timeout=60)).data)
                results["bystander_epoch"] = reg["epoch"]
                for label, bad in (("missing field", {"type": "heartbeat"}), ("not json", "{{{"),
                                   ("wrong type", {"type": "start", "spec": {}}),
                                   ("another node's hardware",
                                    {"type": "hardware", "hardware": register("node-bystander")["hardware"]}),
                                   ("oversized", "x" * (5 << 20))):
                    res = await _stream(cp, sender, register("node-sender"), then=[bad])
                    results[label] = res
                    # The bystander's stream is untouched: it still talks and is heard.
                    await wb.send_str(json.dumps({"type": "heartbeat", "seq": 1}))
                    nodes = await asyncio.to_thread(cp.nodes)
                    results.setdefault("bystander", []).append(
                        (nodes["node-bystander"]["connected"], nodes["node-bystander"]["epoch"]))
                results["bystander_closed"] = wb.closed
        return results

    out = asyncio.run(scenario())
    for label in ("missing field", "not json", "wrong type", "another node's hardware"):
        res = out[label]
        assert kinds(res)[0] == "registered" and kinds(res)[-1] == "error", (label, res)
        assert res["close_code"] == 1008, (label, res)
    # 1009 when the close frame reaches the sender before it finishes writing;
    # either way the server stopped reading and closed that stream.
    assert out["oversized"]["close_code"] in (1009, 1006), out["oversized"]
    assert out["bystander"] == [(True, out["bystander_epoch"])] * 5
    assert out["bystander_closed"] is False
    log = cp.server.output(10**7)
    assert "invalid heartbeat message: /: 'seq' is a required property" in log
    assert "exceeds limit" in log
    assert "hardware: node_id 'node-bystander' is not this stream's node 'node-sender'" in log


def test_a_new_registration_supersedes_the_old_stream(cp):
    cert = cp.pki.node("node-epochs")

    async def scenario() -> tuple[int, int, Any, dict]:
        url = cp.url.replace("https", "wss") + STREAM
        ctx = client_context(cp.pki.ca_cert, *cert)
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(url, ssl=ctx) as old:
                await old.send_str(json.dumps(register("node-epochs")))
                e1 = json.loads((await old.receive(timeout=60)).data)["epoch"]
                async with s.ws_connect(url, ssl=ctx) as new:
                    await new.send_str(json.dumps(register("node-epochs")))
                    e2 = json.loads((await new.receive(timeout=60)).data)["epoch"]
                    closed = await old.receive(timeout=60)
                    while closed.type == aiohttp.WSMsgType.TEXT:  # liveness, sent right after registered
                        closed = await old.receive(timeout=60)
                    node = (await asyncio.to_thread(cp.nodes))["node-epochs"]
                    return e1, e2, closed.type, node

    e1, e2, closed, node = asyncio.run(scenario())
    assert e2 > e1
    assert closed in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING)
    assert node["epoch"] == e2 and node["connected"] is True


def test_node_certificate_is_refused_on_the_admin_api(cp, tmp_path):
    node_cert = cp.pki.node("node-admin-probe")
    paths = ["/v1/nodes", "/v1/replicas", "/v1/catalog", "/v1/explain/tiny", "/metrics", "/v1/router/endpoints"]
    with cp.client(cert=node_cert) as c:
        for p in paths:
            r = c.get(p)
            assert r.status_code == 403, (p, r.status_code, r.text)
            assert "certificate role 'node' cannot act as an admin" in r.json()["error"]
        assert c.post("/v1/reload").status_code == 403
        assert c.post("/v1/replicas/x/drain").status_code == 403
        assert c.get("/healthz").status_code == 200
    # ...even together with a valid admin token.
    ctx = client_context(cp.pki.ca_cert, *node_cert)
    with httpx.Client(base_url=cp.url, verify=ctx, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as c:
        assert c.get("/v1/nodes").status_code == 403
    with cp.client() as c:  # admin certificate
        assert c.get("/v1/nodes").status_code == 200
    with cp.client(token=ADMIN_TOKEN) as c:
        assert c.get("/v1/nodes").status_code == 200
    with cp.client(token="not-the-token") as c:
        assert c.get("/v1/nodes").status_code == 403
    with httpx.Client(base_url=cp.url, verify=client_context(cp.pki.ca_cert)) as c:
        r = c.get("/v1/nodes")
        assert r.status_code == 401 and "Bearer" in r.headers.get("WWW-Authenticate", "")
        assert c.get("/healthz").status_code == 200
    res = cp.ctl("nodes", env={"LLMGW_CERT": str(node_cert[0]), "LLMGW_KEY": str(node_cert[1])}, check=False)
    assert res.returncode == 1 and "HTTP 403" in res.stderr and "cannot act as an admin" in res.stderr
    res = cp.ctl("nodes", "-o", "json", env={"LLMGW_CERT": "", "LLMGW_KEY": "", "LLMGW_TOKEN": ADMIN_TOKEN})
    assert isinstance(json.loads(res.stdout)["nodes"], list)


def test_metrics_show_node_state_and_nvlink_peers_per_gpu(cp):
    cert = cp.pki.node("node-metrics")
    res = stream(cp, cert, register("node-metrics"), hold=True)
    assert kinds(res)[:1] == ["registered"]
    with cp.client() as c:
        text = c.get("/metrics").text
    assert 'llmgw_gpu_nvlink_peers{gpu="0",node="node-metrics"} 1.0' in text
    assert 'llmgw_gpu_nvlink_peers{gpu="1",node="node-metrics"} 1.0' in text
    assert 'llmgw_node_state{node="node-metrics",state="ready"} 1.0' in text
    assert 'llmgw_node_gpus{node="node-metrics"} 2.0' in text


def test_invalid_reload_keeps_the_running_catalog(cp):
    before = cp.get("/v1/catalog")
    good = yaml.safe_load(cp.config_path.read_text())
    try:
        bad = {**good, "profiles": [{"name": "sim", "engine": "vllm", "tensor_parallel_size": "two"}]}
        cp.write_config(bad)
        cp.server.signal(signal.SIGHUP)
        until(lambda: "reload refused, the running catalog stays in force" in cp.server.output(10**7),
              "the refused SIGHUP reload in the log", on_timeout=cp.server.output)
        assert cp.get("/v1/catalog")["models"] == before["models"]
        assert cp.get("/v1/catalog")["profiles"] == before["profiles"]
        with cp.client() as c:
            r = c.post("/v1/reload")
        assert r.status_code == 400
        body = r.json()
        assert body["ok"] is False and any("/profiles/0/tensor_parallel_size" in e for e in body["errors"])
        assert cp.get("/v1/catalog")["profiles"] == before["profiles"]
        cp.config_path.write_text("api: [unclosed\n")
        with cp.client() as c:
            r = c.post("/v1/reload")
        assert r.status_code == 400 and "not valid YAML" in " ".join(r.json()["errors"])
        # A valid file is applied.
        changed = {**good, "models": good["models"] + [{"name": "second", "source": "org/second"}]}
        cp.write_config(changed)
        with cp.client() as c:
            r = c.post("/v1/reload")
        assert r.status_code == 200 and r.json()["ok"] is True
        assert {m["name"] for m in cp.get("/v1/catalog")["models"]} == {"tiny", "second"}
    finally:
        cp.write_config(good)
        with cp.client() as c:
            c.post("/v1/reload")


def test_server_certificate_without_the_dialed_ip_is_refused_by_the_agent(tmp_path):
    # The certificate names "localhost" only; the agent dials 127.0.0.1.
    # Hostname verification reads the SANs (never the CN), so this must fail.
    pki = make_pki(tmp_path / "pki", hosts=("localhost",), ips=())
    with Fleet(tmp_path / "fleet", nodes={"a": 1}, replicas=0, pki=pki, api_host="localhost",
               stream_host="127.0.0.1") as f:
        f.start()
        agent = f.agents["a"]
        until(lambda: agent.output().count("reconnecting to") >= 3, "several refused attempts",
              on_timeout=agent.output)
        out = agent.output()
        assert "IP address mismatch" in out, out[-3000:]
        assert f.nodes() == {}, "the agent never reached the control plane"
        # The same agent dialing a name the certificate does hold gets in.
        agent.terminate()
        cfg_path = agent.cwd / "agent.yaml"
        cfg = yaml.safe_load(cfg_path.read_text())
        cfg["control_plane"]["url"] = f"wss://localhost:{f.port}/v1/agent/stream"
        cfg_path.write_text(yaml.safe_dump(cfg))
        agent.start()
        until(lambda: f.node_ids["a"] in f.nodes(), "the agent registered via localhost", on_timeout=agent.output)


def test_server_without_tls_refuses_to_start_unless_insecure_is_explicit_and_loud(tmp_path):
    import subprocess

    from fleet import Proc, free_port, llmgw_argv

    port = free_port()
    doc = {"api": {"listen": {"host": "127.0.0.1", "port": port}},
           "models": [], "profiles": [], "deployments": []}
    cfg = tmp_path / "server.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    refused = subprocess.run(llmgw_argv("server", "--config", str(cfg)), capture_output=True, text=True,
                             timeout=120, stdin=subprocess.DEVNULL)
    assert refused.returncode != 0
    assert "insecure_no_tls" in refused.stderr + refused.stdout

    cfg.write_text(yaml.safe_dump({**doc, "insecure_no_tls": True}))
    server = Proc("insecure server", llmgw_argv("server", "--config", str(cfg)), tmp_path / "server.log",
                  tmp_path).start()

    def answers() -> bool:
        assert server.alive(), server.output()
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
        except httpx.TransportError:
            return False

    try:
        until(answers, "the explicitly insecure server to answer plain HTTP", on_timeout=server.output)
        assert "WARNING" in server.output() and "WITHOUT TLS" in server.output()
    finally:
        server.terminate()
