"""Mutual TLS over real sockets: an aiohttp server on ``server_context``,
clients on ``client_context`` (plain ``ssl`` sockets and aiohttp).

In TLS 1.3 the client's side of the handshake completes before the server
has judged the client certificate, so a refused client learns of it on its
first read. asyncio's TLS transport closes such a connection without sending
the alert and reports the reason only to the ``asyncio`` logger in debug
mode, so the test server runs its loop in debug mode and collects those
reasons: each refusal test asserts the client got nothing, the handler never
ran, and the server refused for the expected reason (not merely some reason).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import socket
import ssl
import threading
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from cryptography import x509

from llmgw.tls.ca import init_ca
from llmgw.tls.context import client_context, server_context
from llmgw.tls.files import write_pair
from llmgw.tls.identity import IdentityError, check_admin_identity, check_node_identity, peer_identity
from llmgw.tls.issue import issue_admin, issue_node, issue_server

from fleet import self_signed_node

pytestmark = pytest.mark.integration

TIMEOUT = 60.0  # generous: a loaded 2-core machine must not turn slowness into failure


# ------------------------------------------------------------------ PKI


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, tuple[Path, Path] | Path]:
    d = tmp_path_factory.mktemp("pki")
    ca = init_ca(d / "ca")
    other_ca = init_ca(d / "other-ca")
    past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=3)
    pairs = {
        "server": issue_server(ca, ["localhost"], ["127.0.0.1"]),
        "server-dns-only": issue_server(ca, ["localhost"], []),
        "server-ip-only": issue_server(ca, [], ["127.0.0.1"]),
        "node-a1": issue_node(ca, "gpu-a1"),
        "node-a2": issue_node(ca, "gpu-a2"),
        "admin": issue_admin(ca, "alice"),
        "expired-node": issue_node(ca, "gpu-a1", 1, now=past),
        "other-ca-node": issue_node(other_ca, "gpu-a1"),
        "self-signed-node": self_signed_node("gpu-a1"),
        "server-as-client": issue_server(ca, ["gpu-a1"], []),
    }
    out: dict = {name: write_pair(d / name, *pem) for name, pem in pairs.items()}
    out["ca"] = ca.cert_path
    return out


def client(pki, name: str | None) -> ssl.SSLContext:
    if name is None:
        return client_context(pki["ca"])
    return client_context(pki["ca"], *pki[name])


# --------------------------------------------------------------- server


HITS = web.AppKey("hits", list)


async def whoami(request: web.Request) -> web.Response:
    """Reads the verified peer identity and applies the node or admin check."""
    request.app[HITS].append(request.path)
    try:
        ident = peer_identity(request.transport.get_extra_info("ssl_object"))
        if "node" in request.query:
            check_node_identity(ident, request.query["node"])
        if "admin" in request.query:
            check_admin_identity(ident)
    except IdentityError as exc:
        return web.json_response({"refused": exc.reason}, status=403)
    return web.json_response({"role": ident.role, "name": ident.name, "serial": ident.serial})


class HandshakeFailures(logging.Handler):
    """Collects the reasons asyncio logs (debug mode only) for failed server handshakes."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, ssl.SSLError) and "SSL handshake failed" in record.getMessage():
            self.reasons.append(getattr(exc, "verify_message", None) or exc.reason or str(exc))


class TLSServer:
    """An aiohttp application on its own event loop thread, bound to an ephemeral port."""

    def __init__(self, ctx: ssl.SSLContext):
        self.ctx = ctx
        self.hits: list[str] = []
        self.failures = HandshakeFailures()
        self.loop = asyncio.new_event_loop()
        self.loop.set_debug(True)
        self.loop.slow_callback_duration = 3600  # debug mode is on for the handshake reasons only
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def _start(self) -> None:
        app = web.Application()
        app[HITS] = self.hits
        app.router.add_get("/v1/whoami", whoami)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        await web.SockSite(self.runner, sock, ssl_context=self.ctx).start()

    def wait_failure(self) -> str:
        """The next handshake failure reason the server logged."""
        deadline = time.monotonic() + TIMEOUT
        while not self.failures.reasons:
            if time.monotonic() > deadline:
                pytest.fail("the server logged no handshake failure")
            time.sleep(0.01)
        return self.failures.reasons.pop(0)

    def __enter__(self) -> "TLSServer":
        log = logging.getLogger("asyncio")
        self._old_level = log.level
        log.setLevel(logging.DEBUG)
        log.addHandler(self.failures)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(TIMEOUT)
        return self

    def __exit__(self, *exc) -> None:
        assert self.runner is not None
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(TIMEOUT)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT)
        self.loop.close()
        log = logging.getLogger("asyncio")
        log.removeHandler(self.failures)
        log.setLevel(self._old_level)


@pytest.fixture
def server(pki):
    with TLSServer(server_context(pki["ca"], *pki["server"])) as s:
        yield s


def handshake(port: int, ctx: ssl.SSLContext, server_hostname: str = "127.0.0.1") -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    try:
        return ctx.wrap_socket(raw, server_hostname=server_hostname)
    except BaseException:
        raw.close()
        raise


def refusal(server: TLSServer, ctx: ssl.SSLContext) -> str:
    """Connect, read, expect nothing back; return the reason the server refused."""
    try:
        with handshake(server.port, ctx) as tls:
            data = tls.recv(1)
    except (ssl.SSLError, ConnectionResetError):
        data = b""  # an alert or a reset: refused either way
    assert data == b"", f"the server answered {data!r}"
    return server.wait_failure()


def get(port: int, ctx: ssl.SSLContext, query: str = "") -> tuple[int, dict]:
    """One request with aiohttp's client, the way agents and ctl talk to the control plane."""

    async def go():
        timeout = aiohttp.ClientTimeout(total=TIMEOUT)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(f"https://127.0.0.1:{port}/v1/whoami{query}", ssl=ctx) as resp:
                return resp.status, json.loads(await resp.text())

    return asyncio.run(go())


# ---------------------------------------------------------------- accepted


def test_valid_node_connects_and_its_identity_is_read(pki, server):
    status, body = get(server.port, client(pki, "node-a1"), "?node=gpu-a1")
    assert status == 200
    cert = x509.load_pem_x509_certificate(pki["node-a1"][0].read_bytes())
    assert body == {"role": "node", "name": "gpu-a1", "serial": cert.serial_number}
    assert server.hits == ["/v1/whoami"]


def test_plain_ssl_socket_client_reads_server_identity(pki, server):
    with handshake(server.port, client(pki, "node-a1")) as tls:
        assert tls.version() == "TLSv1.3"
        ident = peer_identity(tls)
        assert (ident.role, ident.name) == ("server", "localhost")


def test_admin_connects_and_passes_admin_check(pki, server):
    assert get(server.port, client(pki, "admin"), "?admin=1") == (200, {
        "role": "admin", "name": "alice",
        "serial": x509.load_pem_x509_certificate(pki["admin"][0].read_bytes()).serial_number,
    })


# ------------------------------------------------------ refused at handshake


@pytest.mark.parametrize(
    "cert, reason",
    [
        ("self-signed-node", "self-signed certificate"),
        ("other-ca-node", "unable to get local issuer certificate"),
        ("expired-node", "certificate has expired"),
        ("server-as-client", "unsuitable certificate purpose"),
        (None, "PEER_DID_NOT_RETURN_A_CERTIFICATE"),
    ],
)
def test_refused_at_handshake(pki, server, cert, reason):
    assert refusal(server, client(pki, cert)) == reason
    assert server.hits == []


@pytest.mark.parametrize("cert", ["other-ca-node", None])
def test_refused_for_aiohttp_client_too(pki, server, cert):
    with pytest.raises(aiohttp.ClientError):
        get(server.port, client(pki, cert), "?node=gpu-a1")
    assert server.wait_failure()
    assert server.hits == []


def test_tls12_client_refused(pki, server):
    ctx = client(pki, "node-a1")
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises(ssl.SSLError):
        handshake(server.port, ctx).close()
    assert server.wait_failure() == "UNSUPPORTED_PROTOCOL"
    assert server.hits == []


# ------------------------------------------- verified, but identity refused


@pytest.mark.parametrize("claimed", ["Gpu-A1", "GPU-A1", "gpu-a1."])
def test_cn_spelling_variants_refused(pki, server, claimed):
    status, body = get(server.port, client(pki, "node-a1"), f"?node={claimed}")
    assert status == 403
    assert body == {"refused": f"certificate CN 'gpu-a1' does not match claimed node id '{claimed}'"}


def test_another_nodes_valid_certificate_refused(pki, server):
    status, body = get(server.port, client(pki, "node-a2"), "?node=gpu-a1")
    assert (status, body) == (403, {"refused": "certificate CN 'gpu-a2' does not match claimed node id 'gpu-a1'"})


def test_admin_certificate_cannot_register_as_node(pki, server):
    status, body = get(server.port, client(pki, "admin"), "?node=alice")
    assert (status, body) == (403, {"refused": "certificate role 'admin' cannot register as a node"})


def test_node_certificate_cannot_act_as_admin(pki, server):
    status, body = get(server.port, client(pki, "node-a1"), "?admin=1")
    assert (status, body) == (403, {"refused": "certificate role 'node' cannot act as an admin"})


# --------------------------------------------- optional client certificates


def test_optional_client_cert_admits_anonymous_but_not_foreign(pki):
    with TLSServer(server_context(pki["ca"], *pki["server"], require_client_cert=False)) as s:
        status, body = get(s.port, client(pki, None), "?node=gpu-a1")
        assert (status, body) == (403, {"refused": "the peer presented no certificate"})
        assert refusal(s, client(pki, "other-ca-node")) == "unable to get local issuer certificate"
        assert get(s.port, client(pki, "node-a1"), "?node=gpu-a1")[0] == 200


# ------------------------------------------------- server name verification


def test_server_cert_without_dialed_ip_refused_by_client(pki):
    with TLSServer(server_context(pki["ca"], *pki["server-dns-only"])) as s:
        with pytest.raises(ssl.SSLCertVerificationError) as info:
            handshake(s.port, client(pki, "node-a1"), server_hostname="127.0.0.1")
        assert "IP address mismatch" in info.value.verify_message
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            get(s.port, client(pki, "node-a1"), "?node=gpu-a1")
        # the same certificate is fine for the name it does carry
        with handshake(s.port, client(pki, "node-a1"), server_hostname="localhost") as tls:
            assert peer_identity(tls).name == "localhost"
        assert s.hits == []


def test_server_cert_with_ip_san_accepted_for_that_ip(pki):
    with TLSServer(server_context(pki["ca"], *pki["server-ip-only"])) as s:
        assert get(s.port, client(pki, "node-a1"), "?node=gpu-a1")[0] == 200
        with pytest.raises(ssl.SSLCertVerificationError) as info:
            handshake(s.port, client(pki, "node-a1"), server_hostname="localhost")
        assert "Hostname mismatch" in info.value.verify_message


def test_server_cert_from_another_ca_refused_by_client(pki, tmp_path):
    other = init_ca(tmp_path / "rogue")
    rogue = write_pair(tmp_path / "rogue-server", *issue_server(other, ["localhost"], ["127.0.0.1"]))
    with TLSServer(server_context(pki["ca"], *rogue)) as s:
        with pytest.raises(ssl.SSLCertVerificationError) as info:
            handshake(s.port, client(pki, "node-a1"))
        assert "unable to get local issuer certificate" in info.value.verify_message


# ------------------------------------------------------------- CA rotation


def test_trust_bundle_with_old_and_new_ca_accepts_both(pki, tmp_path):
    """The CA rotation procedure: during the overlap every host trusts a bundle
    of both CAs, so certificates from either verify in both directions."""
    new_ca = init_ca(tmp_path / "ca-new")
    bundle = tmp_path / "fleet-ca.crt"
    bundle.write_bytes(pki["ca"].read_bytes() + new_ca.cert_path.read_bytes())
    new_server = write_pair(tmp_path / "server-new", *issue_server(new_ca, ["localhost"], ["127.0.0.1"]))
    new_node = write_pair(tmp_path / "node-new", *issue_node(new_ca, "gpu-a2"))
    with TLSServer(server_context(bundle, *new_server)) as s:
        assert get(s.port, client_context(bundle, *pki["node-a1"]), "?node=gpu-a1")[0] == 200
        assert get(s.port, client_context(bundle, *new_node), "?node=gpu-a2")[0] == 200
        # a host still trusting only the old CA refuses the new server certificate
        with pytest.raises(ssl.SSLCertVerificationError):
            handshake(s.port, client_context(pki["ca"], *pki["node-a1"]))
