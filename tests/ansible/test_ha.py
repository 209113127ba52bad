"""playbooks/site.yml on a fleet with three control planes: the etcd members
(llmgw.fleet.etcd), the control planes' `ha` section, and agents and routers given
every control plane, through ansible-playbook on this machine (every host is this
machine in a directory of its own, as inventory/local has it, on free loopback
ports; services are plain background processes).

check mode on a fresh machine writes nothing; the first run forms a three-member
etcd cluster with TLS on every listener, starts three control planes of which
exactly one leads, and its last play proves every declared replica Ready through
the leader and a completion answered through the standalone router; a check of the
converged fleet changes nothing (a second apply: the molecule `fleet` scenario). etcd
is on a CA of its own: its client port takes only the control planes' etcd client
certificates (an agent's, a router's, the control plane's server certificate and the
operator's, all from the fleet CA, are refused), and its peer port only members'
certificates. SIGKILL of the leader: a standby leads within the
lease. (upgrade.yml restarting the control planes one at a time, the leader last, under
streaming load, is the molecule `fleet` scenario's.)
And a fleet with one control plane is rendered as it always was: no `ha`,
one control-plane URL as a string.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import ssl
import stat
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from fleet_harness import REPO, run_playbook

from tests.support.ports import free_port
from tests.support.procfs import processes_under

SITE = REPO / "playbooks" / "site.yml"
LOCAL = REPO / "inventory" / "local"
CPS = ("local-cp1", "local-cp2", "local-cp3")
LEASE_TTL, RENEW = 4, 1
# The module fixture is four ansible-playbook runs (check, apply, check, upgrade.yml) with three control planes; it counts
# against the first test's limit.
pytestmark = [
    pytest.mark.timeout(2400),
    pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (Debian: etcd-server)"),
]


def stop_everything(root: Path) -> None:
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 5)):
        for pid in processes_under(root, environ=True):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while processes_under(root, environ=True) and time.monotonic() < deadline:
            time.sleep(0.2)


def inventory(root: Path, hosts: dict) -> Path:
    """An inventory beside inventory/local's group_vars and files, with these hosts."""
    inv = root / "inventory"
    inv.mkdir()
    (inv / "group_vars").symlink_to(LOCAL / "group_vars")
    (inv / "files").symlink_to(LOCAL / "files")
    (inv / "hosts.yml").write_text(yaml.safe_dump({"all": {"children": hosts}}))
    return inv / "hosts.yml"


def source_copy(root: Path) -> Path:
    """The runtime is built from a copy of the checkout taken now (see test_site)."""
    source = root / "source"
    shutil.copytree(REPO / "agent", source / "agent", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, source / name)
    return source


@pytest.fixture(scope="module")
def ha(tmp_path_factory):
    root = tmp_path_factory.mktemp("ha")
    ports = {cp: {"llmgw_api_port": free_port(), "llmgw_etcd_client_port": free_port(),
                  "llmgw_etcd_peer_port": free_port()} for cp in CPS}
    router = free_port()
    first = 42000 + (os.getpid() % 100) * 100
    hosts = {
        "llmgw_control_plane": {"hosts": {cp: {**p, "llmgw_ha_address": "127.0.0.1"} for cp, p in ports.items()}},
        "llmgw_agents": {"hosts": {"local-gpu0": {}}},
        "llmgw_routers": {"hosts": {"local-router": {"llmgw_router_address": "127.0.0.1"}}},
    }
    inv = inventory(root, hosts)
    extravars = {
        "llmgw_source_dir": str(source_copy(root)),
        "llmgw_prefix": str(root / "fleet") + "/{{ inventory_hostname }}",
        "llmgw_pki_ca_dir": str(root / "pki"),
        # standalone routers: a standby's in-process router knows no replica
        "llmgw_control_plane_router": False,
        "llmgw_router": {"listen": {"host": "127.0.0.1", "port": router}, "allow_unauthenticated": True},
        "llmgw_engine_ports": {"first": first, "last": first + 99},
        "etcd_install": False,
        "etcd_binary": shutil.which("etcd"),
        "llmgw_ha_lease_ttl": LEASE_TTL,
        "llmgw_ha_renew_interval": RENEW,
        "llmgw_verify_retries": 120,
    }
    runs: dict = {"root": root, "ports": ports, "router": router}
    try:
        runs["check-fresh"] = run_playbook(SITE, root / "runs", inventory=inv, extravars=extravars, check=True, diff=True)
        runs["wrote-in-check"] = [p for p in (root / "fleet", root / "pki") if p.exists()]
        runs["apply"] = run_playbook(SITE, root / "runs", inventory=inv, extravars=extravars)
        runs["check-again"] = run_playbook(SITE, root / "runs", inventory=inv, extravars=extravars, check=True, diff=True)
        yield runs
    finally:
        stop_everything(root)


def admin_context(root: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(root / "pki" / "ca.crt"))
    ctx.load_cert_chain(str(root / "pki" / "admin.crt"), str(root / "pki" / "admin.key"))
    return ctx


def roles(ha) -> dict[str, str]:
    """Each control plane's answer to an admin read: leader, standby, or why it did not answer."""
    out = {}
    for cp, p in ha["ports"].items():
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{p['llmgw_api_port']}/v1/replicas",
                                        context=admin_context(ha["root"]), timeout=5) as response:
                out[cp] = response.headers.get("X-Llmgw-Role") or "leader"
        except (OSError, urllib.error.URLError) as e:
            out[cp] = f"no answer: {e}"
    return out


def installed(ha, host: str, name: str) -> dict:
    return yaml.safe_load((ha["root"] / "fleet" / host / "etc" / "llmgw" / name).read_text())


def test_check_mode_on_a_fresh_machine_changes_nothing(ha):
    run = ha["check-fresh"]
    assert run.rc == 0, run.explain()
    assert ha["wrote-in-check"] == []


def test_site_forms_etcd_and_one_control_plane_leads_and_the_fleet_serves(ha):
    run = ha["apply"]
    assert run.rc == 0, run.explain()
    health = run.task("Wait until the cluster answers healthy")
    assert sorted(r.host for r in health if r.status == "ok") == sorted(CPS), run.explain()
    completion = [r for r in run.task("Send one chat completion through each router") if r.status == "ok"]
    assert completion and completion[0].res["json"]["choices"], run.explain()
    assert sorted(roles(ha).values()) == ["leader", "standby", "standby"], roles(ha)


def test_the_documents_name_every_control_plane_and_etcd_member(ha):
    apis = [f"127.0.0.1:{ha['ports'][cp]['llmgw_api_port']}" for cp in CPS]
    etcd = [f"https://127.0.0.1:{ha['ports'][cp]['llmgw_etcd_client_port']}" for cp in CPS]
    for cp in CPS:
        server = installed(ha, cp, "server.yaml")
        assert server["ha"]["etcd"]["endpoints"] == etcd
        assert server["ha"]["name"] == cp
        assert server["ha"]["advertise_url"] == f"https://127.0.0.1:{ha['ports'][cp]['llmgw_api_port']}"
        assert server["ha"]["etcd"]["cert"].endswith("/etcd-client.crt")
        key = Path(server["ha"]["etcd"]["key"])
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
        data = ha["root"] / "fleet" / cp / "var" / "lib" / "llmgw" / "etcd"
        assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert installed(ha, "local-gpu0", "agent.yaml")["control_plane"]["url"] == [
        f"wss://{a}/v1/agent/stream" for a in apis]
    assert installed(ha, "local-router", "router.yaml")["control_plane"]["url"] == [f"https://{a}" for a in apis]


def test_a_check_of_the_converged_fleet_changes_nothing(ha):
    # A second apply of this fleet is the molecule `fleet` scenario's idempotence step, on real
    # hosts under systemd; here it would be two minutes of the longest ansible lane.
    run = ha["check-again"]
    assert run.rc == 0, run.explain()
    assert run.changed() == 0, run.explain()


def etcd_status(ha, port_key: str, path: str, cert: Path, key: Path, body: bytes | None = None,
                ca: Path | None = None) -> int:
    """A request to the first member's client or peer listener with this certificate: the HTTP status.
    With a CA, the member's certificate is verified against it; without, it is not looked at, so
    only etcd's check of ours decides."""
    if ca is None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ctx = ssl.create_default_context(cafile=str(ca))
    ctx.load_cert_chain(str(cert), str(key))
    port = ha["ports"][CPS[0]][port_key]
    with urllib.request.urlopen(urllib.request.Request(f"https://127.0.0.1:{port}{path}", data=body),
                                context=ctx, timeout=5) as response:
        return response.status


def tls(ha, host: str, name: str) -> Path:
    return ha["root"] / "fleet" / host / "etc" / "llmgw" / "tls" / name


RANGE = ("/v3/kv/range", b'{"key": "Lw=="}')


def test_etcd_serves_the_control_planes_and_takes_only_members_as_peers(ha):
    """The control planes' certificate reads through the JSON gateway they use, and the member
    proves itself with a certificate of the etcd CA, which the fleet CA does not vouch for; at
    the peer listener a member's certificate is taken and an agent's refused."""
    etcd_ca = tls(ha, "local-cp2", "etcd-ca.crt")
    client = (tls(ha, "local-cp2", "etcd-client.crt"), tls(ha, "local-cp2", "etcd-client.key"))
    assert etcd_status(ha, "llmgw_etcd_client_port", RANGE[0], *client, body=RANGE[1], ca=etcd_ca) == 200
    with pytest.raises(urllib.error.URLError) as unverified:
        etcd_status(ha, "llmgw_etcd_client_port", RANGE[0], *client, body=RANGE[1], ca=ha["root"] / "pki" / "ca.crt")
    assert isinstance(unverified.value.reason, ssl.SSLCertVerificationError), unverified.value
    member = (tls(ha, "local-cp2", "etcd.crt"), tls(ha, "local-cp2", "etcd.key"))
    assert etcd_status(ha, "llmgw_etcd_peer_port", "/members", *member, ca=etcd_ca) == 200
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        etcd_status(ha, "llmgw_etcd_peer_port", "/members", tls(ha, "local-gpu0", "node.crt"),
                    tls(ha, "local-gpu0", "node.key"))


@pytest.mark.parametrize("who", ["agent", "router", "control plane server", "operator"])
def test_etcd_client_port_refuses_every_fleet_ca_certificate(ha, who):
    """#26: a stolen node certificate (every GPU node holds one) must not write the control
    planes' store - leadership, grant secret, cordons, epoch. etcd trusts only its own CA, so
    no certificate of the fleet CA is an etcd client, whatever usages it carries."""
    cert, key = {
        "agent": (tls(ha, "local-gpu0", "node.crt"), tls(ha, "local-gpu0", "node.key")),
        "router": (tls(ha, "local-router", "router.crt"), tls(ha, "local-router", "router.key")),
        "control plane server": (tls(ha, "local-cp1", "server.crt"), tls(ha, "local-cp1", "server.key")),
        "operator": (ha["root"] / "pki" / "admin.crt", ha["root"] / "pki" / "admin.key"),
    }[who]
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        etcd_status(ha, "llmgw_etcd_client_port", RANGE[0], cert, key, body=RANGE[1])
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        etcd_status(ha, "llmgw_etcd_client_port", "/v3/kv/put", cert, key,
                    body=b'{"key": "L2xsbWd3L2xlYWRlcg==", "value": "bWFsbG9yeQ=="}')


def test_the_etcd_ca_is_apart_from_the_fleet_ca(ha):
    """Its key stays on the controller (0600); members and control planes get its certificate,
    agents and routers nothing of it."""
    pki = ha["root"] / "pki"
    assert stat.S_IMODE((pki / "etcd" / "ca.key").stat().st_mode) == 0o600
    assert (pki / "etcd" / "ca.crt").read_bytes() != (pki / "ca.crt").read_bytes()
    for cp in CPS:
        assert tls(ha, cp, "etcd-ca.crt").read_bytes() == (pki / "etcd" / "ca.crt").read_bytes()
        assert stat.S_IMODE(tls(ha, cp, "etcd.key").stat().st_mode) == 0o600
        assert installed(ha, cp, "server.yaml")["ha"]["etcd"]["ca"] == str(tls(ha, cp, "etcd-ca.crt"))
    for host in ("local-gpu0", "local-router"):
        assert not list(tls(ha, host, "").glob("etcd*"))


def test_etcd_refuses_a_certificate_its_crl_names(ha):
    """etcd reads no llmgw revocation list: the pki role gives the members a CRL signed by
    etcd's CA (every serial on the list), which etcd reads at every handshake. One naming a
    control plane's etcd client certificate: refused at once; the role's again: taken."""
    pki = ha["root"] / "pki" / "etcd"
    ca = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    installed_crl = tls(ha, CPS[0], "etcd-ca.crl")
    original = installed_crl.read_bytes()
    assert x509.load_pem_x509_crl(original).is_signature_valid(ca.public_key())
    client = (tls(ha, "local-cp2", "etcd-client.crt"), tls(ha, "local-cp2", "etcd-client.key"))
    serial = x509.load_pem_x509_certificate(client[0].read_bytes()).serial_number
    now = datetime.datetime.now(datetime.timezone.utc)
    crl = (x509.CertificateRevocationListBuilder().issuer_name(ca.subject).last_update(now)
           .next_update(now + datetime.timedelta(days=1))
           .add_revoked_certificate(x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build())
           .sign(serialization.load_pem_private_key((pki / "ca.key").read_bytes(), None), hashes.SHA256()))
    staged = installed_crl.with_name("etcd-ca.crl.test")
    try:
        staged.write_bytes(crl.public_bytes(serialization.Encoding.PEM))
        staged.replace(installed_crl)
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            etcd_status(ha, "llmgw_etcd_client_port", RANGE[0], *client, body=RANGE[1])
    finally:
        staged.write_bytes(original)
        staged.replace(installed_crl)
    assert etcd_status(ha, "llmgw_etcd_client_port", RANGE[0], *client, body=RANGE[1]) == 200


def test_a_standby_leads_after_the_leader_is_killed(ha):
    """Last: it leaves the fleet with two control planes."""
    before = roles(ha)
    (leader,) = [cp for cp, role in before.items() if role == "leader"]
    record = ha["root"] / "fleet" / leader / "var" / "lib" / "llmgw" / "run" / "llmgw-server.pid"
    os.kill(json.loads(record.read_text())["pid"], signal.SIGKILL)
    deadline = time.monotonic() + LEASE_TTL + RENEW + 10  # the lease, a campaign, and a loaded machine's slack
    after = roles(ha)
    while time.monotonic() < deadline and list(after.values()).count("leader") != 1:
        time.sleep(0.5)
        after = roles(ha)
    assert list(after.values()).count("leader") == 1 and after[leader].startswith("no answer"), after


def test_one_control_plane_is_rendered_as_before(tmp_path):
    """No ha, no etcd client certificate, one URL as a string: the quickstart's documents."""
    inv = inventory(tmp_path, {"llmgw_control_plane": {"hosts": {"local-cp": {}}},
                               "llmgw_agents": {"hosts": {"local-gpu0": {}}}})
    playbook = tmp_path / "render.yml"
    playbook.write_text(yaml.safe_dump([{
        "hosts": "all", "gather_facts": False, "roles": ["llmgw.fleet.llmgw"],
        "tasks": [{"name": "Show", "ansible.builtin.debug": {"msg": {
            "server": "{{ llmgw_server_config }}", "agent": "{{ llmgw_agent_config.control_plane }}",
            "router": "{{ llmgw_router_config.control_plane }}", "ha": "{{ llmgw_ha }}"}}}],
    }]))
    run = run_playbook(playbook, tmp_path / "runs", inventory=inv)
    assert run.rc == 0, run.explain()
    shown = {r.host: r.res["msg"] for r in run.task("Show")}
    assert "ha" not in shown["local-cp"]["server"] and shown["local-cp"]["ha"] is False
    assert shown["local-gpu0"]["agent"]["url"] == "wss://127.0.0.1:8443/v1/agent/stream"
    assert shown["local-gpu0"]["router"]["url"] == "https://127.0.0.1:8443"
