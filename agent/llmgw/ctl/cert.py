"""``llmgw ctl cert``: create the fleet CA and issue certificates from it.

Issuing is a command rather than remembered openssl invocations so that
every certificate in the fleet has the same extensions, the same subject
layout and SANs that were checked before signing.  ``cert revoke`` edits
the revocation list (``llmgw.tls.revocation``) the control plane, routers
and agents enforce.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import NameOID

from llmgw.tls.ca import DEFAULT_KEY_TYPE, KEY_TYPE_ALIASES, KEY_TYPES, CAError, init_ca, load_ca
from llmgw.tls.files import write_pair, write_public
from llmgw.tls.identity import certificate_role, certificate_usages
from llmgw.tls.revocation import RevocationError, add_revocations, normalise
from llmgw.tls.issue import (
    DEFAULT_DAYS,
    ROLES,
    IssueError,
    issue_admin,
    issue_node,
    issue_server,
    sign_csr,
)

KEY_TYPE_CHOICES = sorted([*KEY_TYPES, *KEY_TYPE_ALIASES])


def _fail(message: str) -> int:
    print(f"llmgw ctl cert: error: {message}", file=sys.stderr)
    return 1


def _guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn expected failures into one clear line and exit status 1."""

    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (CAError, IssueError) as exc:
            return _fail(str(exc))
        except OSError as exc:
            return _fail(f"{exc.filename or ''}: {exc.strerror or exc}".lstrip(": "))

    run.__name__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


def _print_issued(crt: Path, key: Path, pem: bytes) -> None:
    cert = x509.load_pem_x509_certificate(pem)
    print(f"wrote {crt}")
    print(f"wrote {key} (mode 0600)")
    for line in describe_lines(cert):
        print(f"  {line}")


# ------------------------------------------------------------------ commands


@_guarded
def cmd_init(args: argparse.Namespace) -> int:
    ca = init_ca(args.dir, common_name=args.common_name, days=args.days, key_type=args.key_type, force=args.force)
    print(f"wrote {ca.key_path} (mode 0600; keep it on this machine only)")
    print(f"wrote {ca.cert_path} (distribute to every host as the fleet CA)")
    for line in describe_lines(ca.cert):
        print(f"  {line}")
    return 0


@_guarded
def cmd_hosts(args: argparse.Namespace) -> int:
    """``server``, ``router`` and ``engine``: certificates naming the hosts and addresses they are dialed at."""
    ca = load_ca(args.dir)
    cert_pem, key_pem = issue_server(ca, args.host, args.ip, args.days, key_type=args.key_type, role=args.role)
    crt, key = write_pair(args.out or Path(args.dir) / args.role, cert_pem, key_pem)
    _print_issued(crt, key, cert_pem)
    return 0


def _host_args(p: argparse.ArgumentParser, who: str) -> None:
    p.add_argument("--host", action="extend", nargs="+", default=[], metavar="NAME",
                   help=f"DNS name {who} dial (repeatable)")
    p.add_argument("--ip", action="extend", nargs="+", default=[], metavar="ADDR",
                   help=f"IP address {who} dial (repeatable)")


@_guarded
def cmd_node(args: argparse.Namespace) -> int:
    ca = load_ca(args.dir)
    cert_pem, key_pem = issue_node(ca, args.node_id, args.days, key_type=args.key_type)
    crt, key = write_pair(args.out or Path(args.dir) / f"node-{args.node_id}", cert_pem, key_pem)
    _print_issued(crt, key, cert_pem)
    return 0


@_guarded
def cmd_admin(args: argparse.Namespace) -> int:
    ca = load_ca(args.dir)
    cert_pem, key_pem = issue_admin(ca, args.name, args.days, key_type=args.key_type)
    crt, key = write_pair(args.out or Path(args.dir) / f"admin-{args.name}", cert_pem, key_pem)
    _print_issued(crt, key, cert_pem)
    return 0


@_guarded
def cmd_sign(args: argparse.Namespace) -> int:
    ca = load_ca(args.dir)
    csr_pem = Path(args.csr).read_bytes()
    cert_pem = sign_csr(ca, csr_pem, args.role, args.name, hosts=args.host, ips=args.ip, days=args.days)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_public(out, cert_pem)
    print(f"wrote {out}")
    for line in describe_lines(x509.load_pem_x509_certificate(cert_pem)):
        print(f"  {line}")
    return 0


@_guarded
def cmd_show(args: argparse.Namespace) -> int:
    data = Path(args.file).read_bytes()
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        try:
            certs = [x509.load_der_x509_certificate(data)]
        except ValueError:
            return _fail(f"{args.file}: no PEM or DER certificate found")
    if args.json:
        print(json.dumps([describe(c) for c in certs], indent=2))
        return 0
    for i, cert in enumerate(certs):
        if i:
            print()
        for line in describe_lines(cert):
            print(line)
    return 0


DEFAULT_REVOKED = "~/.local/share/llmgw/pki/revoked.txt"  # beside the collection's default CA directory


def _load_any(path: Path) -> list[x509.Certificate]:
    data = path.read_bytes()
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError:
        try:
            return [x509.load_der_x509_certificate(data)]
        except ValueError:
            raise RevocationError(f"{path}: no PEM or DER certificate found") from None


def revocation_entries(targets: Sequence[str], reason: str = "") -> list[tuple[str, str, str]]:
    """``(kind, value, comment)`` for each SERIAL or certificate file; ``RevocationError`` for anything else."""
    entries = []
    for target in targets:
        path = Path(target).expanduser()
        if path.is_file():
            for cert in _load_any(path):
                ident = certificate_role(cert) or "no-role"
                cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
                name = cn[0].value if cn else "?"
                comment = f"{ident} {name}, expires {cert.not_valid_after_utc:%Y-%m-%d}" + (f": {reason}" if reason else "")
                entries.append(("serial", format(cert.serial_number, "x"), comment))
            continue
        try:
            entries.append(("serial", normalise("serial", target), reason))
        except ValueError:
            raise RevocationError(f"{target!r} is neither a certificate file nor a hexadecimal serial") from None
    return entries


@_guarded
def cmd_revoke(args: argparse.Namespace) -> int:
    """Add certificates to the revocation list, atomically; the processes reading it pick it up on SIGHUP."""
    path = Path(args.list or os.environ.get("LLMGW_REVOKED") or DEFAULT_REVOKED).expanduser()
    try:
        added = add_revocations(path, revocation_entries(args.targets, args.reason or ""))
    except (RevocationError, ValueError) as e:
        return _fail(str(e))
    for line in added:
        print(f"revoked: {line}")
    if len(added) < len(args.targets):
        print(f"{len(args.targets) - len(added)} already on the list")
    print(f"{path}: install it where tls.revoked points and send SIGHUP (systemctl reload) to the control plane, "
          f"routers and agents")
    return 0


# --------------------------------------------------------------- describing


def _sans(cert: x509.Certificate) -> list[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    out = []
    for n in san:
        kind = {x509.DNSName: "DNS", x509.IPAddress: "IP", x509.UniformResourceIdentifier: "URI"}.get(type(n), type(n).__name__)
        out.append(f"{kind}:{n.value}")
    return out


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return False


def describe(cert: x509.Certificate, now: dt.datetime | None = None) -> dict:
    """The facts an operator checks on a certificate, as plain data."""
    now = now or dt.datetime.now(dt.timezone.utc)
    left = cert.not_valid_after_utc - now
    return {
        "subject": cert.subject.rfc4514_string(),
        "issuer": cert.issuer.rfc4514_string(),
        "role": "ca" if _is_ca(cert) else certificate_role(cert),
        "serial": format(cert.serial_number, "x"),
        "sans": _sans(cert),
        "extended_key_usage": list(certificate_usages(cert)),
        "not_before": cert.not_valid_before_utc.isoformat(),
        "not_after": cert.not_valid_after_utc.isoformat(),
        "days_left": int(left.total_seconds() / 86400),  # whole days, truncated toward zero
        "expired": left.total_seconds() <= 0,
        "sha256": cert.fingerprint(hashes.SHA256()).hex(),
    }


def describe_lines(cert: x509.Certificate, now: dt.datetime | None = None) -> list[str]:
    d = describe(cert, now)
    if d["expired"]:
        left = f"EXPIRED {-d['days_left']} day(s) ago" if d["days_left"] < 0 else "EXPIRED today"
    else:
        left = str(d["days_left"])
    return [
        f"subject:    {d['subject']}",
        f"issuer:     {d['issuer']}",
        f"role:       {d['role'] or 'none (OU and extended key usage do not name a role)'}",
        f"serial:     {d['serial']}",
        f"SANs:       {', '.join(d['sans']) or 'none'}",
        f"EKU:        {', '.join(d['extended_key_usage']) or 'none'}",
        f"not after:  {d['not_after']}",
        f"days left:  {left}",
    ]


# ------------------------------------------------------------------- parser


def _days(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of days") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"validity must be at least 1 day, got {n}")
    return n


def _common(p: argparse.ArgumentParser, role: str | None) -> None:
    p.add_argument("--dir", required=True, type=Path, help="CA directory (holds ca.key and ca.crt)")
    if role is not None:
        p.add_argument(
            "--days", type=_days, default=None, help=f"validity in days (default {DEFAULT_DAYS[role]})"
        )
        p.add_argument(
            "--key-type", choices=KEY_TYPE_CHOICES, default=DEFAULT_KEY_TYPE, help="key type (default %(default)s)"
        )


def _out(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--out", type=Path, default=None, metavar="PREFIX",
        help=f"write PREFIX.crt and PREFIX.key (mode 0600); default {default}",
    )


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``cert`` and its subcommands; each sets ``func(args) -> int``."""
    cert = subparsers.add_parser("cert", help="create the fleet CA and issue certificates")
    sub = cert.add_subparsers(dest="cert_command", metavar="COMMAND", required=True)

    p = sub.add_parser("init", help="create the fleet CA (ca.key, ca.crt)")
    _common(p, None)
    p.add_argument("--days", type=_days, default=3650, help="CA validity in days (default %(default)s)")
    p.add_argument("--common-name", default="llmgw fleet CA", help="CA subject CN (default %(default)r)")
    p.add_argument("--key-type", choices=KEY_TYPE_CHOICES, default=DEFAULT_KEY_TYPE, help="default %(default)s")
    p.add_argument("--force", action="store_true", help="replace an existing CA (invalidates every certificate)")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("server", help="issue the control plane's server certificate")
    _common(p, "server")
    _host_args(p, "agents")
    _out(p, "DIR/server")
    p.set_defaults(func=cmd_hosts, role="server")

    p = sub.add_parser("router", help="issue a standalone router's certificate (serves clients, reads the watch)")
    _common(p, "router")
    _host_args(p, "clients")
    _out(p, "DIR/router")
    p.set_defaults(func=cmd_hosts, role="router")

    p = sub.add_parser("engine", help="issue a node's engine serving certificate (SANs: the node's fleet address)")
    _common(p, "engine")
    _host_args(p, "routers")
    _out(p, "DIR/engine")
    p.set_defaults(func=cmd_hosts, role="engine")

    p = sub.add_parser("node", help="issue a node's client certificate (CN = node id)")
    p.add_argument("node_id", metavar="NODE_ID")
    _common(p, "node")
    _out(p, "DIR/node-NODE_ID")
    p.set_defaults(func=cmd_node)

    p = sub.add_parser("admin", help="issue an operator's client certificate")
    p.add_argument("name", metavar="NAME", nargs="?", default="admin", help="operator name (default %(default)s)")
    _common(p, "admin")
    _out(p, "DIR/admin-NAME")
    p.set_defaults(func=cmd_admin)

    p = sub.add_parser("sign", help="sign a CSR after checking it against the expected role, name and SANs")
    p.add_argument("csr", metavar="CSR", help="PEM certificate signing request")
    _common(p, None)
    p.add_argument("--days", type=_days, default=None,
                   help="validity in days (default: server/router/node %d, admin %d)" % (DEFAULT_DAYS["node"], DEFAULT_DAYS["admin"]))
    p.add_argument("--role", choices=ROLES, required=True)
    p.add_argument("--name", default=None, help="expected CN (node id or operator name)")
    p.add_argument("--host", action="extend", nargs="+", default=[], metavar="NAME")
    p.add_argument("--ip", action="extend", nargs="+", default=[], metavar="ADDR")
    p.add_argument("--out", type=Path, required=True, metavar="FILE", help="where to write the certificate")
    p.set_defaults(func=cmd_sign)

    p = sub.add_parser("revoke", help="add certificates (by serial or file) to the revocation list")
    p.add_argument("targets", metavar="SERIAL|CERTFILE", nargs="+",
                   help="a serial in hex (as `cert show` prints it) or a certificate file")
    p.add_argument("--list", metavar="FILE", default=None,
                   help=f"the revocation list to edit (default $LLMGW_REVOKED, else {DEFAULT_REVOKED})")
    p.add_argument("--reason", default=None, help="a note kept beside the entry")
    p.set_defaults(func=cmd_revoke)

    p = sub.add_parser("show", help="print a certificate's subject, role, SANs, usages and expiry")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_show)
    return cert


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry (``python -m llmgw.ctl.cert ...``)."""
    parser = argparse.ArgumentParser(prog="llmgw ctl")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
