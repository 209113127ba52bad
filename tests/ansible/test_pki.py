"""The pki role through ansible-playbook: a CA on the controller, certificates for a
control plane, two nodes and a standalone router (all on this machine, as separate
inventory hosts).

Proves: check/apply/check/apply converges (changed, changed, unchanged,
unchanged) and a re-run re-issues nothing; a corrupted certificate, a changed
SAN list and a certificate inside the renewal window are re-issued, and only
those; keys are 0600 and owned by the service user; the certificates carry the
roles the runtime's identity check reads, and a real TLS 1.3 handshake with the
runtime's own SSL contexts succeeds with them; a request that does not match the
inventory is refused.
"""

from __future__ import annotations

import getpass
import grp
import os
import shutil
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fleet_harness import PLAYBOOKS, four_runs, run_playbook
from llmgw.tls.context import client_context, server_context
from llmgw.tls.identity import certificate_role, check_node_identity, peer_identity

PKI = PLAYBOOKS / "pki.yml"
AGENTS = ("gpu-a1", "gpu-a2")
ROUTER = "edge-r1"
USER = getpass.getuser()
GROUP = grp.getgrgid(os.getgid()).gr_name


def write_inventory(root: Path, *, extra_names=("cp.fleet.test", "localhost"), agents=AGENTS, **extra) -> Path:
    inv = {
        "all": {
            "vars": {
                "ansible_connection": "local",
                "ansible_python_interpreter": os.sys.executable,
                "llmgw_prefix": str(root / "hosts") + "/{{ inventory_hostname }}",
                "llmgw_service_user": USER,
                "llmgw_service_group": GROUP,
                "llmgw_service_user_create": False,
                "llmgw_pki_ca_dir": str(root / "ca"),
                "llmgw_control_plane_address": "127.0.0.1",
                "llmgw_pki_server_extra_names": list(extra_names),
                **extra,
            },
            "children": {
                "llmgw_control_plane": {"hosts": {"cp": None}},
                "llmgw_agents": {"hosts": {a: None for a in agents}},
                "llmgw_routers": {"hosts": {ROUTER: {"llmgw_router_address": "127.0.0.1"}}},
            },
        }
    }
    path = root / "inventory.yml"
    path.write_text(yaml.safe_dump(inv))
    return path


def tls(root: Path, host: str) -> Path:
    return root / "hosts" / host / "etc" / "llmgw" / "tls"


def cert(root: Path, host: str, name: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate((tls(root, host) / f"{name}.crt").read_bytes())


def serials_or_none(root: Path) -> dict[str, int | None]:
    """Like serials(), with None for a certificate that cannot be read."""
    out: dict[str, int | None] = {}
    for key, path in [("cp", tls(root, "cp") / "server.crt"), *[(a, tls(root, a) / "node.crt") for a in AGENTS],
                      (ROUTER, tls(root, ROUTER) / "router.crt"), ("admin", root / "ca" / "admin.crt")]:
        try:
            out[key] = x509.load_pem_x509_certificate(path.read_bytes()).serial_number
        except ValueError:
            out[key] = None
    return out


def serials(root: Path) -> dict[str, int]:
    out = {"cp": cert(root, "cp", "server").serial_number}
    out.update({a: cert(root, a, "node").serial_number for a in AGENTS})
    out[ROUTER] = cert(root, ROUTER, "router").serial_number
    out["admin"] = x509.load_pem_x509_certificate((root / "ca" / "admin.crt").read_bytes()).serial_number
    return out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """check, apply, check, apply on a fresh fleet; what check mode wrote is recorded
    before the first real run."""
    root = tmp_path_factory.mktemp("pki")
    inv = write_inventory(root)
    runs, written_by_check, serials_seen = [], None, []
    for check in (True, False, True, False):
        runs.append(run_playbook(PKI, root / "runs", inventory=inv, check=check, diff=True))
        if written_by_check is None:
            written_by_check = [p for p in (root / "ca", root / "hosts") if p.exists()]
        if not check and runs[-1].rc == 0:
            serials_seen.append(serials(root))
    return root, runs, written_by_check, serials_seen


@pytest.fixture
def fleet(pristine, tmp_path):
    """A private copy of the issued fleet, to change and re-run."""
    root = tmp_path / "fleet"
    shutil.copytree(pristine[0] / "ca", root / "ca")
    shutil.copytree(pristine[0] / "hosts", root / "hosts")
    return root


def test_check_apply_check_apply_converges(pristine):
    root, (check1, apply1, check2, apply2), _, _ = pristine
    for run in (check1, apply1, check2, apply2):
        assert run.rc == 0, run.explain()
    assert check1.changed() > 0 and apply1.changed() > 0
    assert check2.changed() == 0, check2.explain()
    assert apply2.changed() == 0, apply2.explain()


def test_check_mode_on_a_fresh_fleet_writes_nothing(pristine):
    assert pristine[2] == []


def test_a_plain_rerun_reissues_nothing(pristine):
    first, second = pristine[3]
    assert first == second


def test_keys_are_private_and_owned_by_the_service_user(pristine):
    root = pristine[0]
    keys = [tls(root, "cp") / "server.key", tls(root, ROUTER) / "router.key"] + [tls(root, a) / "node.key" for a in AGENTS]
    keys += [root / "ca" / "ca.key", root / "ca" / "admin.key"]
    for key in keys:
        st = key.stat()
        assert stat.S_IMODE(st.st_mode) == 0o600, key
        assert st.st_uid == os.getuid(), key
    assert stat.S_IMODE((root / "ca").stat().st_mode) == 0o700
    for host in ("cp", ROUTER, *AGENTS):
        assert stat.S_IMODE(tls(root, host).stat().st_mode) == 0o750
    # The CA key stays on the controller: no host directory holds it.
    assert not list((root / "hosts").rglob("ca.key"))


def test_certificates_carry_the_roles_the_runtime_reads(pristine):
    root = pristine[0]
    server = cert(root, "cp", "server")
    assert certificate_role(server) == "server"
    assert server.subject.rfc4514_string() == "CN=cp.fleet.test,OU=server,O=llmgw"
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["cp.fleet.test", "localhost"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    for agent in AGENTS:
        node = cert(root, agent, "node")
        assert certificate_role(node) == "node"
        assert node.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == agent
        eku = node.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
        uris = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert uris.get_values_for_type(x509.UniformResourceIdentifier) == [f"urn:llmgw:node:{agent}"]
        bc = node.extensions.get_extension_for_class(x509.BasicConstraints)
        assert bc.critical and not bc.value.ca
        # the engines' serving certificate: serverAuth only, at the node's fleet address (its host name here)
        engine = cert(root, agent, "engine")
        assert certificate_role(engine) == "engine"
        assert list(engine.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
            ExtendedKeyUsageOID.SERVER_AUTH]
        names = engine.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert names.get_values_for_type(x509.DNSName) == [agent]
    router = cert(root, ROUTER, "router")
    assert certificate_role(router) == "router"
    assert router.subject.rfc4514_string() == f"CN={ROUTER},OU=router,O=llmgw"
    assert set(router.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == {
        ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    san = router.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [ROUTER]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert not (tls(root, "cp") / "router.crt").exists(), "no in-process router declared: no router certificate"
    admin = x509.load_pem_x509_certificate((root / "ca" / "admin.crt").read_bytes())
    assert certificate_role(admin) == "admin"
    ca = x509.load_pem_x509_certificate((root / "ca" / "ca.crt").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for host in ("cp", *AGENTS):
        assert (tls(root, host) / "ca.crt").read_bytes() == (root / "ca" / "ca.crt").read_bytes()


def test_a_real_mutual_tls_handshake_with_the_runtime_contexts(pristine):
    root = pristine[0]
    cp, node = tls(root, "cp"), tls(root, "gpu-a2")
    server_ctx = server_context(cp / "ca.crt", cp / "server.crt", cp / "server.key")
    client_ctx = client_context(node / "ca.crt", node / "node.crt", node / "node.key")
    listener = socket.create_server(("127.0.0.1", 0))
    seen = {}

    def serve():
        conn, _ = listener.accept()
        with server_ctx.wrap_socket(conn, server_side=True) as s:
            seen["client"] = peer_identity(s)
            s.sendall(b"ok")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with socket.create_connection(listener.getsockname(), timeout=30) as raw:
        # Dialed by IP: the address must be an IP SAN, not a DNS one.
        with client_ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            assert s.version() == "TLSv1.3"
            assert peer_identity(s).role == "server"
            assert s.recv(2) == b"ok"
    thread.join(30)
    listener.close()
    check_node_identity(seen["client"], "gpu-a2")


def test_a_corrupted_certificate_and_a_san_change_are_reissued_and_only_they(fleet, tmp_path):
    before = serials(fleet)
    (tls(fleet, "gpu-a1") / "node.crt").write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n")
    corrupted = (tls(fleet, "gpu-a1") / "node.crt").read_bytes()
    inv = write_inventory(fleet, extra_names=("cp.fleet.test", "localhost", "cp2.fleet.test", "::1"))
    check = run_playbook(PKI, tmp_path / "runs", inventory=inv, check=True, diff=True)
    assert check.rc == 0, check.explain()
    assert check.changed("cp") > 0 and check.changed("gpu-a1") > 0 and check.changed("gpu-a2") == 0, check.explain()
    assert {k: v for k, v in serials_or_none(fleet).items()} == {**before, "gpu-a1": None}  # check mode wrote nothing
    assert (tls(fleet, "gpu-a1") / "node.crt").read_bytes() == corrupted

    run = run_playbook(PKI, tmp_path / "runs", inventory=inv)
    assert run.rc == 0, run.explain()
    after = serials(fleet)
    assert after["gpu-a1"] != before["gpu-a1"] and after["cp"] != before["cp"]
    assert after["gpu-a2"] == before["gpu-a2"] and after["admin"] == before["admin"]
    assert run.changed("gpu-a2") == 0, run.explain()
    san = cert(fleet, "cp", "server").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["cp.fleet.test", "localhost", "cp2.fleet.test"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "::1"]
    facts = {r.host: r.res["ansible_facts"]["pki_changed"]
             for r in run.task("Record which credentials changed, for the services that load them")}
    assert facts["gpu-a1"] == ["node"] and facts["cp"] == ["server"] and facts["gpu-a2"] == []


def test_a_certificate_inside_the_renewal_window_is_reissued_once(fleet, tmp_path):
    before = serials(fleet)
    # The issued certificates have 90 days left; a 100-day window puts all of them inside it.
    inv = write_inventory(fleet, llmgw_pki_cert_days=120, llmgw_pki_renew_days=100)
    run = run_playbook(PKI, tmp_path / "runs", inventory=inv)
    assert run.rc == 0, run.explain()
    after = serials(fleet)
    assert all(after[k] != before[k] for k in before)
    node = cert(fleet, "gpu-a1", "node")
    assert (node.not_valid_after_utc - node.not_valid_before_utc).days >= 119


def test_a_node_id_that_cannot_be_certified_is_refused(tmp_path):
    inv = write_inventory(tmp_path, agents=("GPU-A1",))
    run = run_playbook(PKI, tmp_path / "runs", inventory=inv)
    assert run.rc != 0
    (failed,) = [r for r in run.results if r.status == "failed"]
    assert failed.host == "GPU-A1" and "refusing to certify this node" in failed.res["msg"]
    assert not (tmp_path / "hosts" / "GPU-A1" / "etc" / "llmgw" / "tls" / "node.crt").exists()


def test_a_request_that_does_not_match_the_inventory_is_refused(tmp_path):
    good_subject = [{"O": "llmgw"}, {"OU": "node"}, {"CN": "gpu-a1"}]
    good_sans = ["URI:urn:llmgw:node:gpu-a1"]

    def req(label, subject=good_subject, sans=good_sans, usage="clientAuth", ca=False):
        return {"label": label, "subject": subject, "sans": sans, "usage": usage, "ca": ca}

    requests = [
        req("matching"),
        req("another node's name", subject=[{"O": "llmgw"}, {"OU": "node"}, {"CN": "gpu-a2"}]),
        req("admin role", subject=[{"O": "llmgw"}, {"OU": "admin"}, {"CN": "gpu-a1"}]),
        req("extra name", sans=good_sans + ["DNS:evil.example"]),
        req("server usage", usage="serverAuth"),
        req("a CA", ca=True),
    ]
    tmp_path.mkdir(exist_ok=True)
    run = run_playbook(
        PLAYBOOKS / "pki_verify.yml", tmp_path / "runs",
        extravars={"requests": requests, "workdir": str(tmp_path)},
    )
    verdicts = run.task("Compare the requests with the inventory")
    assert [v.status for v in verdicts] == ["ok"] + ["failed"] * 5, run.explain()
    assert run.rc != 0
    messages = [v.res.get("msg", "") for v in verdicts[1:]]
    for msg in messages:
        assert msg.startswith("localhost: refusing to sign the node certificate request for gpu-a1: "), msg
    assert "commonName=gpu-a2 is not organizationName=llmgw, organizationalUnitName=node, commonName=gpu-a1" in messages[0]
    assert "organizationalUnitName=admin" in messages[1]
    assert "names URI:urn:llmgw:node:gpu-a1, DNS:evil.example are not URI:urn:llmgw:node:gpu-a1" in messages[2]
    assert "extended key usage TLS Web Server Authentication is not clientAuth" in messages[3]
    assert "basic constraints CA:TRUE are not CA:FALSE" in messages[4]


def test_the_router_certificate_serves_clients_and_reads_the_watch(pristine):
    """HTTPS to a client trusting the fleet CA, dialed by address; and a client certificate
    the control plane's server context accepts, whose identity is the router role."""
    from llmgw.tls.context import public_server_context
    from llmgw.tls.identity import check_router_identity

    root = pristine[0]
    cp, r = tls(root, "cp"), tls(root, ROUTER)
    cases = [(public_server_context(r / "router.crt", r / "router.key"), client_context(r / "ca.crt"), "router"),
             (server_context(cp / "ca.crt", cp / "server.crt", cp / "server.key"),
              client_context(r / "ca.crt", r / "router.crt", r / "router.key"), "server")]
    for server_ctx, client_ctx, server_role in cases:
        listener = socket.create_server(("127.0.0.1", 0))
        seen = {}

        def serve(server_ctx=server_ctx, listener=listener, seen=seen):
            conn, _ = listener.accept()
            with server_ctx.wrap_socket(conn, server_side=True) as s:
                seen["client"] = peer_identity(s) if s.getpeercert(binary_form=True) else None
                s.sendall(b"ok")

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        with socket.create_connection(listener.getsockname(), timeout=30) as raw:
            with client_ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                assert peer_identity(s).role == server_role
                assert s.recv(2) == b"ok"
        thread.join(30)
        listener.close()
        if server_role == "server":
            check_router_identity(seen["client"])


def _listed(path: Path) -> set[int]:
    from llmgw.tls.revocation import load_revocations

    return set(load_revocations(path).serials)


def test_a_rekey_revokes_what_it_replaced_and_every_host_gets_the_list(fleet, tmp_path):
    before = serials(fleet)
    engines_before = {a: cert(fleet, a, "engine").serial_number for a in AGENTS}
    run = run_playbook(PKI, tmp_path / "runs", inventory=write_inventory(fleet), extravars={"llmgw_pki_rekey": True})
    assert run.rc == 0, run.explain()
    after = serials(fleet)
    assert all(after[k] != before[k] for k in before)
    assert all(cert(fleet, a, "engine").serial_number != engines_before[a] for a in AGENTS)
    # every certificate the rekey replaced, the engines' serving certificates included
    assert _listed(fleet / "ca" / "revoked.txt") == set(before.values()) | set(engines_before.values())
    for host in ("cp", ROUTER, *AGENTS):
        assert (tls(fleet, host) / "revoked.txt").read_bytes() == (fleet / "ca" / "revoked.txt").read_bytes()
    facts = {r.host: r.res["ansible_facts"]["pki_revocations_changed"]
             for r in run.task("Record whether this host's revocation list changed, for the services to reload")}
    assert facts == {h: True for h in ("cp", ROUTER, *AGENTS)}


def test_revoke_on_request_by_name_and_serial(fleet, tmp_path):
    before = serials(fleet)
    engine_before = cert(fleet, "gpu-a1", "engine").serial_number
    inv = write_inventory(fleet)
    run = run_playbook(PKI, tmp_path / "runs", inventory=inv, extravars={"llmgw_pki_revoke": "gpu-a1,0xDEAD:BEEF"})
    assert run.rc == 0, run.explain()
    # every certificate the named host holds: its node certificate and its engines' serving certificate
    revoked = {before["gpu-a1"], engine_before, 0xDEADBEEF}
    assert _listed(fleet / "ca" / "revoked.txt") == revoked
    after = serials(fleet)
    assert after["gpu-a1"] != before["gpu-a1"]  # the named host was given a new certificate
    assert cert(fleet, "gpu-a1", "engine").serial_number != engine_before
    assert after["gpu-a2"] == before["gpu-a2"] and after["cp"] == before["cp"]
    assert _listed(tls(fleet, "gpu-a2") / "revoked.txt") == revoked

    listed = (fleet / "ca" / "revoked.txt").read_bytes()
    bad = run_playbook(PKI, tmp_path / "runs", inventory=inv, extravars={"llmgw_pki_revoke": ["no-such-host"]})
    assert bad.rc != 0
    assert "no-such-host is neither the inventory name of a host in this play" in bad.explain()
    assert (fleet / "ca" / "revoked.txt").read_bytes() == listed and serials(fleet) == after  # refused before acting
