"""`llmgw ctl cert`: argument handling, files written, messages, exit codes."""

import argparse
import json
import os
import stat

import pytest
from cryptography import x509

from llmgw.ctl import cert as cert_cmd
from llmgw.tls.ca import load_ca
from llmgw.tls.identity import certificate_role


def run(argv):
    parser = argparse.ArgumentParser(prog="llmgw ctl")
    cert_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.fixture
def ca_dir(tmp_path):
    d = tmp_path / "ca"
    assert run(["cert", "init", "--dir", str(d)]) == 0
    return d


def load(p):
    return x509.load_pem_x509_certificate(p.read_bytes())


def test_init(ca_dir, capsys):
    assert mode(ca_dir / "ca.key") == 0o600
    assert load_ca(ca_dir).cert.subject.rfc4514_string() == "CN=llmgw fleet CA,O=llmgw"


def test_init_refuses_existing_and_force_replaces(ca_dir, capsys):
    before = (ca_dir / "ca.crt").read_bytes()
    capsys.readouterr()
    assert run(["cert", "init", "--dir", str(ca_dir)]) == 1
    err = capsys.readouterr().err
    assert "already exists" in err and "--force" in err
    assert (ca_dir / "ca.crt").read_bytes() == before
    assert run(["cert", "init", "--dir", str(ca_dir), "--force", "--days", "400"]) == 0
    assert (ca_dir / "ca.crt").read_bytes() != before


def test_server(ca_dir, tmp_path, capsys):
    out = tmp_path / "out" / "cp"
    argv = ["cert", "server", "--dir", str(ca_dir), "--host", "cp.example", "localhost",
            "--ip", "127.0.0.1", "--host", "cp2.example", "--days", "10", "--out", str(out)]
    assert run(argv) == 0
    crt, key = tmp_path / "out" / "cp.crt", tmp_path / "out" / "cp.key"
    assert mode(key) == 0o600 and mode(crt) == 0o644
    c = load(crt)
    san = c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["cp.example", "localhost", "cp2.example"]
    assert [str(i) for i in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert certificate_role(c) == "server"
    stdout = capsys.readouterr().out
    assert f"wrote {crt}" in stdout and "DNS:cp.example" in stdout and "IP:127.0.0.1" in stdout


def test_server_without_hosts_fails_clearly(ca_dir, capsys):
    assert run(["cert", "server", "--dir", str(ca_dir)]) == 1
    assert "ignores the common name" in capsys.readouterr().err
    assert not (ca_dir / "server.key").exists()


def test_node_default_prefix(ca_dir):
    assert run(["cert", "node", "gpu-a1", "--dir", str(ca_dir)]) == 0
    c = load(ca_dir / "node-gpu-a1.crt")
    assert certificate_role(c) == "node"
    assert c.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == "gpu-a1"
    assert mode(ca_dir / "node-gpu-a1.key") == 0o600


def test_node_bad_id(ca_dir, capsys):
    assert run(["cert", "node", "Gpu-A1", "--dir", str(ca_dir)]) == 1
    assert "did you mean 'gpu-a1'" in capsys.readouterr().err
    assert not list(ca_dir.glob("node-*"))


def test_node_without_ca(tmp_path, capsys):
    assert run(["cert", "node", "gpu-a1", "--dir", str(tmp_path)]) == 1
    assert "create the CA first" in capsys.readouterr().err


def test_bad_days_rejected_by_parser(ca_dir, capsys):
    with pytest.raises(SystemExit) as info:
        run(["cert", "node", "gpu-a1", "--dir", str(ca_dir), "--days", "0"])
    assert info.value.code == 2
    assert "at least 1 day" in capsys.readouterr().err


def test_admin_default_name_and_validity(ca_dir):
    assert run(["cert", "admin", "--dir", str(ca_dir)]) == 0
    c = load(ca_dir / "admin-admin.crt")
    assert certificate_role(c) == "admin"
    assert (c.not_valid_after_utc - c.not_valid_before_utc).days == 30


def test_admin_named(ca_dir, tmp_path):
    assert run(["cert", "admin", "alice", "--dir", str(ca_dir), "--out", str(tmp_path / "alice")]) == 0
    assert load(tmp_path / "alice.crt").subject.rfc4514_string() == "CN=alice,OU=admin,O=llmgw"


def test_show(ca_dir, capsys):
    run(["cert", "node", "gpu-a1", "--dir", str(ca_dir), "--days", "20"])
    capsys.readouterr()
    assert run(["cert", "show", str(ca_dir / "node-gpu-a1.crt")]) == 0
    out = capsys.readouterr().out
    assert "subject:    CN=gpu-a1,OU=node,O=llmgw" in out
    assert "role:       node" in out
    assert "SANs:       URI:urn:llmgw:node:gpu-a1" in out
    assert "EKU:        clientAuth" in out
    assert "days left:  19" in out or "days left:  20" in out
    assert "not after:" in out


def test_show_json(ca_dir, capsys):
    capsys.readouterr()
    assert run(["cert", "show", "--json", str(ca_dir / "ca.crt")]) == 0
    [doc] = json.loads(capsys.readouterr().out)
    assert doc["role"] == "ca" and doc["expired"] is False and doc["sans"] == []


def test_show_expired(ca_dir, tmp_path, capsys):
    import datetime as dt

    from llmgw.tls.issue import issue_node

    past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=10)
    pem, _ = issue_node(load_ca(ca_dir), "gpu-a1", 2, now=past)
    (tmp_path / "old.crt").write_bytes(pem)
    capsys.readouterr()
    assert run(["cert", "show", str(tmp_path / "old.crt")]) == 0
    assert "EXPIRED 8 day(s) ago" in capsys.readouterr().out


def test_show_not_a_certificate(tmp_path, capsys):
    (tmp_path / "x").write_text("hello")
    assert run(["cert", "show", str(tmp_path / "x")]) == 1
    assert "no PEM or DER certificate" in capsys.readouterr().err


def test_show_missing_file(tmp_path, capsys):
    assert run(["cert", "show", str(tmp_path / "nope.crt")]) == 1
    assert "nope.crt" in capsys.readouterr().err


def test_sign_csr(ca_dir, tmp_path):
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "gpu-b2")]))
        .sign(key, hashes.SHA256())
    )
    (tmp_path / "req.csr").write_bytes(csr.public_bytes(serialization.Encoding.PEM))
    argv = ["cert", "sign", str(tmp_path / "req.csr"), "--dir", str(ca_dir), "--role", "node"]
    assert run(argv + ["--name", "gpu-b3", "--out", str(tmp_path / "bad.crt")]) == 1
    assert not (tmp_path / "bad.crt").exists()
    assert run(argv + ["--name", "gpu-b2", "--out", str(tmp_path / "b2.crt")]) == 0
    assert certificate_role(load(tmp_path / "b2.crt")) == "node"


def test_standalone_entry(tmp_path):
    import subprocess
    import sys

    d = tmp_path / "ca2"
    proc = subprocess.run(
        [sys.executable, "-m", "llmgw.ctl.cert", "cert", "init", "--dir", str(d)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert (d / "ca.key").exists()


def test_router(ca_dir, capsys):
    assert run(["cert", "router", "--dir", str(ca_dir), "--host", "router-1.example", "--ip", "10.0.0.9"]) == 0
    crt, key = ca_dir / "router.crt", ca_dir / "router.key"
    assert mode(key) == 0o600
    c = load(crt)
    assert certificate_role(c) == "router"
    san = c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["router-1.example"]
    assert "role:       router" in capsys.readouterr().out
    assert run(["cert", "router", "--dir", str(ca_dir)]) == 1
    assert "a router certificate needs at least one DNS name" in capsys.readouterr().err
