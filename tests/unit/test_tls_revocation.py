"""The revocation list: its format, loading and reloading, editing, and the clients' check of the server's role."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import stat

import pytest
from cryptography import x509

from llmgw.ctl import cert as ctl_cert
from llmgw.tls import (
    PeerRefused,
    RevocationError,
    Revocations,
    RevokedError,
    add_revocations,
    control_plane_context,
    init_ca,
    issue_admin,
    issue_node,
    issue_router,
    issue_server,
    load_revocations,
    parse_revocations,
    peer_identity,
)
from llmgw.tls.context import server_context
from llmgw.tls.files import write_pair


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca = init_ca(root / "ca")
    out = {"ca": ca, "root": root}
    out["server"] = write_pair(root / "server", *issue_server(ca, ["localhost"], ["127.0.0.1"]))
    out["server2"] = write_pair(root / "server2", *issue_server(ca, ["localhost"], ["127.0.0.1"]))
    out["router"] = write_pair(root / "router", *issue_router(ca, ["localhost"], ["127.0.0.1"]))
    out["node"] = write_pair(root / "node", *issue_node(ca, "gpu-a1"))
    out["admin"] = write_pair(root / "admin", *issue_admin(ca, "alice"))
    return out


def _cert(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


# ----------------------------------------------------------------- the format

def test_format_entries_comments_and_spellings():
    text = """# header comment

    serial 5F3A0C            # uppercase, as openssl prints it
    serial 0x00:ab:cd        # 0x, colons and leading zeros are spelling only
    SHA256 %s  # openssl's colon form
    """ % ":".join(["AB"] * 32)
    rl = parse_revocations(text)
    assert rl.serials == {0x5F3A0C, 0xABCD}
    assert rl.fingerprints == {"ab" * 32}
    assert len(rl) == 3


@pytest.mark.parametrize("line, words", [
    ("serial", "expected 'serial HEX' or 'sha256 HEX'"),
    ("serial 12 34", "expected 'serial HEX' or 'sha256 HEX'"),
    ("fingerprint abcd", "unknown entry kind 'fingerprint'"),
    ("serial xyz", "not hexadecimal"),
    ("sha256 abcd", "has 4 hex digits; a SHA-256 fingerprint has 64"),
    ("serial " + "f" * 41, "longer than 20 bytes"),
])
def test_a_bad_line_invalidates_the_file_and_is_named(line, words):
    with pytest.raises(RevocationError) as e:
        parse_revocations(f"serial 1\n# ok\n{line}\n", "revoked.txt")
    assert str(e.value).startswith("revoked.txt:3: ")
    assert words in str(e.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(RevocationError, match=r"revocation list .*absent\.txt does not exist \(create an empty file"):
        load_revocations(tmp_path / "absent.txt")
    with pytest.raises(RevocationError, match="does not exist"):
        Revocations(tmp_path / "absent.txt")


def test_match_by_serial_and_by_fingerprint(pki):
    server = peer_identity(_cert(pki["server"][0]))
    other = peer_identity(_cert(pki["server2"][0]))
    by_serial = parse_revocations(f"serial {server.serial_hex}\n")
    by_fp = parse_revocations(f"sha256 {server.fingerprint_sha256}\n")
    for rl in (by_serial, by_fp):
        assert rl.match(server) is not None and rl.match(other) is None
        with pytest.raises(RevokedError, match=f"serial {server.serial_hex}.*is revoked"):
            rl.check(server)
        rl.check(other)


# -------------------------------------------------------------- reloading

def test_reload_swaps_the_list_or_keeps_the_running_one(tmp_path, caplog):
    path = tmp_path / "revoked.txt"
    path.write_text("serial 1\n")
    revs = Revocations(path)
    assert revs.current.serials == {1}
    path.write_text("serial 1\nserial 2\n")
    assert revs.reload() is True and revs.current.serials == {1, 2}
    path.write_text("serial 1\nserial nope\n")
    with caplog.at_level(logging.ERROR, "llmgw.tls.revocation"):
        assert revs.reload() is False
    assert revs.current.serials == {1, 2}  # the running list stays
    assert "not reloaded, the running one (2 entries) stays in force" in caplog.text
    assert "revoked.txt:2" in caplog.text
    path.unlink()
    assert revs.reload() is False and revs.current.serials == {1, 2}


def test_no_path_revokes_nothing():
    revs = Revocations(None)
    assert len(revs.current) == 0 and revs.reload() is True


# ----------------------------------------------------------------- editing

def test_add_keeps_text_dedupes_and_writes_atomically(tmp_path):
    path = tmp_path / "pki" / "revoked.txt"
    assert add_revocations(path, [("serial", "AB", "admin alice")]) == ["serial ab  # admin alice"]
    path.write_text(path.read_text() + "# an operator's note\n")
    added = add_revocations(path, [("serial", "0xab", ""), ("sha256", "CD" * 32, "")])
    assert added == [f"sha256 {'cd' * 32}"]
    text = path.read_text()
    assert "# an operator's note" in text and text.count("serial ab") == 1
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []
    assert load_revocations(path).serials == {0xAB}


def test_add_refuses_to_append_to_a_list_its_readers_refuse(tmp_path):
    path = tmp_path / "revoked.txt"
    path.write_text("serial zz\n")
    with pytest.raises(RevocationError, match="revoked.txt:1"):
        add_revocations(path, [("serial", "1", "")])
    assert path.read_text() == "serial zz\n"


def test_ctl_cert_revoke_by_file_and_serial(pki, tmp_path, capsys):
    path = tmp_path / "revoked.txt"
    admin = _cert(pki["admin"][0])
    rc = ctl_cert.main(["cert", "revoke", str(pki["admin"][0]), "DEADBEEF", "--list", str(path),
                        "--reason", "laptop stolen"])
    assert rc == 0, capsys.readouterr().err
    rl = load_revocations(path)
    assert rl.serials == {admin.serial_number, 0xDEADBEEF}
    text = path.read_text()
    assert "admin alice" in text and "laptop stolen" in text
    assert ctl_cert.main(["cert", "revoke", "not-a-serial-or-file", "--list", str(path)]) == 1
    assert "neither a certificate file nor a hexadecimal serial" in capsys.readouterr().err
    assert load_revocations(path) == rl


# ------------------------------------------------------- the server's role

async def _handshake(pki, server_pair, revocations=None) -> tuple[BaseException | None, bytes]:
    """A real TLS server on loopback presenting ``server_pair``; a control-plane client dials it.

    Returns the client's error (None when it connected) and every byte the
    server received after its handshake.
    """
    received = bytearray()
    done = asyncio.Event()

    async def serve(reader, writer):
        try:
            while chunk := await reader.read(4096):
                received.extend(chunk)
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            done.set()
            writer.close()

    sctx = server_context(pki["ca"].cert_path, *server_pair, require_client_cert=False)
    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=sctx)
    port = server.sockets[0].getsockname()[1]
    cctx = control_plane_context(pki["ca"].cert_path, *pki["node"], revocations=revocations)
    error = None
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=cctx, server_hostname="localhost")
        writer.write(b"register")
        await writer.drain()
        writer.close()
    except (ssl.SSLError, OSError) as e:
        error = e
    with pytest.raises(asyncio.TimeoutError) if error is not None else _nothing():
        await asyncio.wait_for(done.wait(), 2.0)  # a refused handshake never reaches the handler
    server.close()
    return error, bytes(received)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_client_talks_to_the_server_role(pki):
    error, received = asyncio.run(_handshake(pki, pki["server"]))
    assert error is None and received == b"register"


def test_client_refuses_a_router_certificate_before_sending(pki):
    error, received = asyncio.run(_handshake(pki, pki["router"]))
    assert isinstance(error, ssl.SSLCertVerificationError)
    assert "role 'router'" in str(error) and "a control plane holds OU=server" in str(error)
    assert received == b""


def test_client_refuses_a_revoked_server(pki, tmp_path):
    path = tmp_path / "revoked.txt"
    path.write_text(f"serial {_cert(pki['server'][0]).serial_number:x}\n")
    revs = Revocations(path)
    error, received = asyncio.run(_handshake(pki, pki["server"], revs))
    assert isinstance(error, ssl.SSLCertVerificationError) and "is revoked" in str(error)
    assert received == b""
    error, received = asyncio.run(_handshake(pki, pki["server2"], revs))  # its replacement is fine
    assert error is None and received == b"register"
    path.write_text("")  # taken off the list: the next handshake reads the reloaded list
    revs.reload()
    error, _ = asyncio.run(_handshake(pki, pki["server"], revs))
    assert error is None


def test_blocking_client_refuses_a_router_certificate(pki):
    """``llmgw ctl`` uses httpx over blocking sockets: the check is on SSLSocket too."""
    import socket
    import threading

    sctx = server_context(pki["ca"].cert_path, *pki["router"], require_client_cert=False)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    received = bytearray()

    def accept():
        conn, _ = listener.accept()
        try:
            with sctx.wrap_socket(conn, server_side=True) as tls:
                tls.settimeout(2)
                while chunk := tls.recv(4096):
                    received.extend(chunk)
        except (OSError, ssl.SSLError):
            pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    cctx = control_plane_context(pki["ca"].cert_path, *pki["admin"])
    with socket.create_connection(("127.0.0.1", port)) as raw:
        with pytest.raises(PeerRefused, match="role 'router'"):
            cctx.wrap_socket(raw, server_hostname="localhost")
    t.join(5)
    listener.close()
    assert received == b""
