"""Node certificates for thousands of simulated agents, issued once and cached.

Every simulated agent proves its node id with its own certificate from the
fleet CA, issued exactly as ``llmgw ctl cert node`` issues one
(``llmgw.tls.issue``: role ``node``, CN = node id).  Keys are EC P-256, the
cheapest type the fleet's TLS accepts.

Generating and signing ten thousand of them costs seconds, and writing twenty
thousand small files with fsync costs more, so the cache is two files in the
cache directory, each written atomically:

* ``keys.json`` (0600): node id -> private key PEM.  Kept across CAs, so a
  rerun against a new CA signs again but never generates keys again;
* ``certs-<CA fingerprint>.json``: node id -> certificate PEM and its expiry,
  one file per CA, so certificates of another CA are never presented.

A certificate that expires within a day is issued again.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from cryptography.hazmat.primitives import hashes, serialization

from llmgw.tls.ca import CertificateAuthority, generate_key, key_to_pem, utcnow
from llmgw.tls.context import client_context
from llmgw.durable import PRIVATE_MODE, PUBLIC_MODE, write_atomic
from llmgw.tls.issue import build_leaf, node_request

KEY_TYPE = "ec-p256"
RENEW_BEFORE = dt.timedelta(days=1)


@dataclass(frozen=True)
class NodeCredentials:
    node_id: str
    cert_pem: bytes
    key_pem: bytes


@dataclass(frozen=True)
class IssueCounts:
    keys_generated: int
    certs_issued: int


def ca_fingerprint(ca: CertificateAuthority) -> str:
    return ca.cert.fingerprint(hashes.SHA256()).hex()[:16]


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError as e:
        raise ValueError(f"{path}: not a certificate cache ({e}); remove it to start afresh") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a certificate cache (not a JSON object); remove it to start afresh")
    return doc


def ensure_credentials(cache_dir: str | os.PathLike[str], ca: CertificateAuthority, node_ids: Iterable[str],
                       now: dt.datetime | None = None) -> tuple[dict[str, NodeCredentials], IssueCounts]:
    """Credentials for every node id, generating and issuing only what the cache lacks."""
    now = now or utcnow()
    d = Path(cache_dir)
    d.mkdir(parents=True, exist_ok=True)
    keys_path, certs_path = d / "keys.json", d / f"certs-{ca_fingerprint(ca)}.json"
    keys: dict[str, str] = _read_json(keys_path)
    certs: dict[str, dict[str, str]] = _read_json(certs_path)
    generated = issued = 0
    out: dict[str, NodeCredentials] = {}
    for node_id in node_ids:
        key_pem = keys.get(node_id)
        if key_pem is None:
            key_pem = key_to_pem(generate_key(KEY_TYPE)).decode()
            keys[node_id] = key_pem
            generated += 1
            certs.pop(node_id, None)  # a certificate for another key is useless
        entry = certs.get(node_id)
        if entry is None or dt.datetime.fromisoformat(entry["not_after"]) - RENEW_BEFORE <= now:
            key = serialization.load_pem_private_key(key_pem.encode(), password=None)
            cert = build_leaf(ca, node_request(node_id), key.public_key(), days=None, now=now)
            entry = {"cert": cert.public_bytes(serialization.Encoding.PEM).decode(),
                     "not_after": cert.not_valid_after_utc.isoformat()}
            certs[node_id] = entry
            issued += 1
        out[node_id] = NodeCredentials(node_id, entry["cert"].encode(), key_pem.encode())
    if generated:
        write_atomic(keys_path, json.dumps(keys).encode(), mode=PRIVATE_MODE)
    if issued:
        write_atomic(certs_path, json.dumps(certs).encode(), mode=PUBLIC_MODE)
    return out, IssueCounts(generated, issued)


def load_credentials(cache_dir: str | os.PathLike[str], ca_cert_fingerprint: str,
                     node_ids: Iterable[str]) -> dict[str, NodeCredentials]:
    """Read already-issued credentials (a worker process reading what its parent issued)."""
    d = Path(cache_dir)
    keys = _read_json(d / "keys.json")
    certs = _read_json(d / f"certs-{ca_cert_fingerprint}.json")
    return {n: NodeCredentials(n, certs[n]["cert"].encode(), keys[n].encode()) for n in node_ids}


class ContextFactory:
    """TLS client contexts built by the project's own ``client_context``.

    ``ssl`` loads a certificate and key only from files, so each pair passes
    through a private temporary file (0600 in a 0700 directory, on tmpfs
    where there is one) that is removed as soon as it is loaded.
    """

    def __init__(self, ca_file: str | os.PathLike[str]):
        self.ca_file = ca_file
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.dir = tempfile.mkdtemp(prefix="llmgw-fleet-sim-", dir=base)

    def context(self, creds: NodeCredentials) -> ssl.SSLContext:
        path = os.path.join(self.dir, "pair.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_MODE)
        try:
            os.write(fd, creds.key_pem + creds.cert_pem)
        finally:
            os.close(fd)
        try:
            return client_context(self.ca_file, path, path)
        finally:
            os.unlink(path)

    def close(self) -> None:
        try:
            os.rmdir(self.dir)
        except OSError:
            pass
