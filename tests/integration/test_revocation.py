"""Revocation and the clients' check of the server's role, through real processes over real mutual TLS.

* A certificate put on the list (``llmgw ctl cert revoke``) and reloaded
  (SIGHUP, ``POST /v1/reload``) is refused by the control plane at once:
  an admin certificate gets 403 (a token beside it changes nothing), a
  node's live stream is closed and its re-dial refused, a router's watch is
  refused; an unparsable list on reload keeps the running one.
* The agent, ``llmgw ctl`` and the router's watch refuse a peer that is not
  the control plane (a router's certificate: serverAuth, the right SAN) or
  whose certificate is revoked, before sending anything: a TLS server here
  records every byte it is sent.
* A configured list that is missing stops each process at start.
"""

from __future__ import annotations

import signal
import socket
import ssl
import threading
from pathlib import Path

import httpx
import pytest
from cryptography import x509

from llmgw.tls import issue_admin, issue_server
from llmgw.tls.context import client_context, server_context
from llmgw.tls.files import write_pair

from fleet import ADMIN_TOKEN, WAIT, Fleet, Proc, edit_agent_config, llmgw_argv, standalone_router, until

pytestmark = pytest.mark.integration


def serial(pair: tuple[Path, Path]) -> str:
    return format(x509.load_pem_x509_certificate(pair[0].read_bytes()).serial_number, "x")


def status(f: Fleet, cert: tuple[Path, Path], token: str | None = None) -> int | None:
    ctx = client_context(f.pki.ca_cert, *cert)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client(base_url=f.url, verify=ctx, headers=headers, timeout=10) as c:
            return c.get("/v1/nodes").status_code
    except httpx.HTTPError:
        return None


def connected(f: Fleet, name: str) -> bool | None:
    node = f.try_node(name)
    return None if node is None else bool(node.get("connected"))


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path, nodes={"a": 1}, replicas=0)
    f.revoked = tmp_path / "revoked.txt"
    f.revoked.write_text("")
    f.config["tls"]["revoked"] = str(f.revoked)
    f.write_config()
    f.start()
    yield f
    f.close()


def test_revoked_certificates_are_refused_after_a_reload(fleet):
    f = fleet
    until(lambda: connected(f, "a"), "node a connected", on_timeout=f.dump)
    router, port = standalone_router(f)
    until(lambda: "endpoint watch: " in router.output() and "endpoint(s) at revision" in router.output(),
          "the router's first watch answer", on_timeout=router.output)
    successor = write_pair(f.pki.dir / "admin-2", *issue_admin(f.pki.ca, "operator-2"))
    assert status(f, f.pki.admin) == 200 and status(f, successor) == 200
    node_cert = f.pki.dir / f"node-{f.node_ids['a']}.crt"

    # what the pki role does after a rekey: the replaced certificates go on the list, then SIGHUP
    f.ctl("cert", "revoke", str(f.pki.admin[0]), str(node_cert), serial(f.pki.router),
          "--list", str(f.revoked), "--reason", "rekeyed")
    f.server.signal(signal.SIGHUP)

    until(lambda: status(f, f.pki.admin) == 403, "the old admin certificate refused", on_timeout=f.server.output)
    assert status(f, f.pki.admin, token=ADMIN_TOKEN) == 403  # a token beside a revoked certificate does not help
    with httpx.Client(base_url=f.url, verify=client_context(f.pki.ca_cert, *f.pki.admin), timeout=10) as c:
        assert "is revoked" in c.get("/v1/nodes").json()["error"]
    assert status(f, successor) == 200

    # the node's live stream is closed by the reload, and its re-dials are refused
    node_id = f.node_ids["a"]
    until(lambda: f"closing the stream of {node_id}: its client certificate" in f.server.output(),
          "the revoked node's stream closed", on_timeout=f.server.output)
    until(lambda: "refused agent stream" in f.server.output() and "is revoked" in f.server.output(),
          "the node's re-dial refused", on_timeout=f.dump)
    with f.client(cert=successor) as c:
        assert [n["connected"] for n in c.get("/v1/nodes").json()["nodes"] if n["node_id"] == node_id] == [False]

    # the poll the router held is ended unanswered by the reload, and its next polls are refused
    until(lambda: "revoked during the poll" in f.server.output(), "the held watch poll ended",
          on_timeout=f.server.output)
    until(lambda: "/v1/router/endpoints" in f.server.output() and "router certificate" in f.server.output()
          and f"serial {serial(f.pki.router)}) is revoked" in f.server.output(),
          "the revoked router's watch refused", on_timeout=f.server.output)

    # a list that no longer parses keeps the running one in force
    f.revoked.write_text("serial not-hex\n")
    f.server.signal(signal.SIGHUP)
    until(lambda: "revocation list not reloaded" in f.server.output(), "the bad list refused",
          on_timeout=f.server.output)
    assert status(f, f.pki.admin) == 403 and status(f, successor) == 200


def test_post_reload_revokes_too(fleet):
    f = fleet
    spare = write_pair(f.pki.dir / "admin-spare", *issue_admin(f.pki.ca, "spare"))
    assert status(f, spare) == 200
    f.ctl("cert", "revoke", str(spare[0]), "--list", str(f.revoked))
    with f.client() as c:
        assert c.post("/v1/reload").status_code == 200
    assert status(f, spare) == 403


class RecordingTLSServer:
    """A TLS server on loopback presenting any fleet certificate, recording what each connection sends."""

    def __init__(self, ca: Path, pair: tuple[Path, Path]):
        self.ctx = server_context(ca, *pair, require_client_cert=False)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        self.accepted = 0
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        data = bytearray()
        try:
            conn.settimeout(5)
            with self.ctx.wrap_socket(conn, server_side=True) as tls:
                while chunk := tls.recv(65536):
                    data.extend(chunk)
        except (OSError, ssl.SSLError):
            pass
        finally:
            self.received.append(bytes(data))

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close()


@pytest.fixture
def pki_fleet(tmp_path):
    f = Fleet(tmp_path, nodes={"a": 1}, replicas=0)  # only its PKI and the agent's config; no server starts
    yield f
    f.close()


@pytest.mark.parametrize("peer", ["router certificate", "revoked server certificate"])
def test_clients_send_nothing_to_a_peer_that_is_not_the_control_plane(pki_fleet, tmp_path, peer):
    f = pki_fleet
    revoked = tmp_path / "revoked.txt"
    if peer == "router certificate":
        pair = f.pki.router
        revoked.write_text("")
        refusal = "role 'router'"
    else:
        pair = write_pair(tmp_path / "stolen-server", *issue_server(f.pki.ca, ["localhost"], ["127.0.0.1"]))
        revoked.write_text(f"serial {serial(pair)}\n")
        refusal = "is revoked"
    impostor = RecordingTLSServer(f.pki.ca_cert, pair)
    url = f"https://127.0.0.1:{impostor.port}"
    try:
        # llmgw ctl with an admin token: no request, so no token
        res = f.ctl("nodes", env={"LLMGW_URL": url, "LLMGW_TOKEN": ADMIN_TOKEN, "LLMGW_REVOKED": str(revoked),
                                  "LLMGW_CERT": "", "LLMGW_KEY": ""}, check=False)
        assert res.returncode == 1 and refusal in res.stderr, res.stderr

        # an agent: no upgrade, no register
        agent = f.agents["a"]
        edit_agent_config(agent, lambda d: (d["control_plane"].update(url=f"wss://127.0.0.1:{impostor.port}"
                                                                          "/v1/agent/stream"),
                                            d["tls"].update(revoked=str(revoked))))
        agent.start()
        until(lambda: agent.output().count("refusing the control plane's certificate") >= 2,
              "the agent to refuse the impostor twice", on_timeout=agent.output)
        assert refusal in agent.output()

        # a standalone router: no watch poll, no ejection report
        router, _ = standalone_router(f, extra={"control_plane": {
            "url": url, "ca": str(f.pki.ca_cert), "cert": str(f.pki.router[0]), "key": str(f.pki.router[1]),
            "revoked": str(revoked)}})
        until(lambda: "refusing the control plane's certificate" in router.output(),
              "the router's watch to refuse the impostor", on_timeout=router.output)
        assert refusal in router.output()
        assert impostor.accepted >= 4
        assert b"".join(impostor.received) == b"", impostor.received

        if peer == "revoked server certificate":
            # SIGHUP re-reads the list (it used to end both processes): taken off it, the
            # server is dialled as the control plane, and what they send is recorded
            revoked.write_text("")
            for proc in (agent, router):
                proc.signal(signal.SIGHUP)
            until(lambda: b"/v1/agent/stream" in b"".join(impostor.received), "the agent's upgrade request",
                  on_timeout=agent.output)
            until(lambda: b"/v1/router/endpoints" in b"".join(impostor.received), "the router's watch poll",
                  on_timeout=router.output)
            assert agent.alive() and router.alive()
        router.kill()  # waiting for its first endpoint set, it would take 30 s to stop
    finally:
        impostor.close()


def test_a_missing_list_stops_each_process_at_start(pki_fleet, tmp_path):
    f = pki_fleet
    missing = tmp_path / "no-such-list.txt"
    f.config["tls"]["revoked"] = str(missing)
    f.write_config()
    f.server.start()
    assert f.server.proc.wait(WAIT) == 2
    assert f"tls.revoked: revocation list {missing} does not exist" in f.server.output()

    agent = f.agents["a"]
    edit_agent_config(agent, lambda d: d["tls"].update(revoked=str(missing)))
    agent.start()
    assert agent.proc.wait(WAIT) == 2
    assert f"tls.revoked: revocation list {missing} does not exist" in agent.output()

    router, _ = standalone_router(f, extra={"control_plane": {
        "url": f.url, "ca": str(f.pki.ca_cert), "cert": str(f.pki.router[0]), "key": str(f.pki.router[1]),
        "revoked": str(missing)}})
    assert router.proc.wait(WAIT) != 0
    assert "/control_plane/revoked" in router.output() and "does not exist" in router.output()
