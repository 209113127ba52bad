"""The fleet's revocation list: certificates refused although the CA signed them and they have not expired.

A certificate is valid for its whole lifetime (90 days for a node, router or
server), so a key that leaked, or was replaced by a rekey, would otherwise
stay a working credential until it expires.  The list names certificates by
serial or by SHA-256 fingerprint; every process that verifies fleet
certificates (the control plane for its clients, agents, routers and
``llmgw ctl`` for the control plane) reads it at start and again on SIGHUP.

The format is plain text, one entry a line, so an operator can read and
edit it and the collection can write it with ordinary tools::

    # anything after '#' is a comment; blank lines are ignored
    serial 5f3a0c...        # the serial in hex, as `llmgw ctl cert show` and `openssl x509 -serial` print it
    sha256 9e:1b:...        # the SHA-256 of the DER certificate (`openssl x509 -fingerprint -sha256`)

Hex is case-insensitive; colons and a ``0x`` prefix are ignored.  A line
that is none of these makes the whole file invalid (with its line number):
a half-understood denylist would silently let through what it meant to
refuse.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes

from .identity import IdentityError, PeerIdentity
from .files import PUBLIC_MODE, write_atomic

log = logging.getLogger("llmgw.tls.revocation")

KINDS = ("serial", "sha256")
_HEX = re.compile(r"[0-9a-f]+")
MAX_SERIAL_HEX = 40  # RFC 5280: at most 20 octets


class RevocationError(Exception):
    """The revocation list cannot be read or parsed; the message names the file (and line)."""


class RevokedError(IdentityError):
    """The peer's certificate is on the revocation list."""


@dataclass(frozen=True)
class RevocationList:
    """Revoked serials and SHA-256 fingerprints (lower-case hex without colons)."""

    serials: frozenset[int] = frozenset()
    fingerprints: frozenset[str] = frozenset()

    def __len__(self) -> int:
        return len(self.serials) + len(self.fingerprints)

    def match(self, identity: PeerIdentity) -> str | None:
        """The entry that revokes ``identity`` ("serial 5f3a..."), or None."""
        return self.match_values(identity.serial, identity.fingerprint_sha256)

    def match_values(self, serial: int, fingerprint_sha256: str = "") -> str | None:
        """The entry that revokes the certificate with this serial and fingerprint, or None."""
        if serial in self.serials:
            return f"serial {serial:x}"
        fp = fingerprint_sha256.lower().replace(":", "")
        if fp and fp in self.fingerprints:
            return f"sha256 {fp}"
        return None

    def check(self, identity: PeerIdentity) -> None:
        """Raise ``RevokedError`` when ``identity``'s certificate is on the list."""
        entry = self.match(identity)
        if entry is not None:
            raise RevokedError(f"certificate {identity.describe()} is revoked ({entry} is on the revocation list)")


def normalise(kind: str, value: str) -> str:
    """The canonical spelling of an entry's value: lower-case hex, no colons, no 0x, no leading zeros in serials.

    Raises ``ValueError`` with the reason when the value is not what ``kind`` needs.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown entry kind {kind!r} (expected one of: {', '.join(KINDS)})")
    v = value.strip().lower().replace(":", "")
    if v.startswith("0x"):
        v = v[2:]
    if not v or not _HEX.fullmatch(v):
        raise ValueError(f"{kind} {value!r} is not hexadecimal")
    if kind == "sha256":
        if len(v) != 64:
            raise ValueError(f"sha256 {value!r} has {len(v)} hex digits; a SHA-256 fingerprint has 64")
        return v
    v = v.lstrip("0") or "0"
    if len(v) > MAX_SERIAL_HEX:
        raise ValueError(f"serial {value!r} is longer than 20 bytes (RFC 5280's limit)")
    return v


def _entries(text: str, source: str) -> Iterator[tuple[str, str]]:
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise RevocationError(f"{source}:{number}: expected 'serial HEX' or 'sha256 HEX', got {line!r}")
        try:
            yield parts[0].lower(), normalise(parts[0].lower(), parts[1])
        except ValueError as e:
            raise RevocationError(f"{source}:{number}: {e}") from None


def parse_revocations(text: str, source: str = "revocation list") -> RevocationList:
    """Parse the list's text; ``RevocationError`` names the first bad line."""
    serials: set[int] = set()
    fingerprints: set[str] = set()
    for kind, value in _entries(text, source):
        if kind == "serial":
            serials.add(int(value, 16))
        else:
            fingerprints.add(value)
    return RevocationList(frozenset(serials), frozenset(fingerprints))


def load_revocations(path: str | os.PathLike[str]) -> RevocationList:
    """Read and parse the list at ``path``; ``RevocationError`` when it is missing, unreadable or invalid."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RevocationError(f"revocation list {p} does not exist (create an empty file to revoke nothing)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RevocationError(f"revocation list {p} cannot be read: {e}") from None
    return parse_revocations(text, str(p))


def certificate_entry(cert: x509.Certificate) -> tuple[str, str]:
    """The entry that revokes ``cert``: its serial (what operators see in ``cert show`` and in logs)."""
    return "serial", format(cert.serial_number, "x")


def fingerprint_entry(cert: x509.Certificate) -> tuple[str, str]:
    return "sha256", cert.fingerprint(hashes.SHA256()).hex()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialise read-modify-write of one list: two operators revoking at once must both land."""
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def add_revocations(path: str | os.PathLike[str], entries: Iterable[tuple[str, str, str]]) -> list[str]:
    """Append ``(kind, value, comment)`` entries to the list at ``path`` (created when absent), atomically.

    The existing text (comments included) is kept as it is; an entry
    already on the list is not added twice.  Returns the lines added.  The
    existing file must parse: appending to a list its readers refuse would
    revoke nothing.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with _locked(p):
        text = p.read_text(encoding="utf-8") if p.exists() else ""
        current = parse_revocations(text, str(p))
        have = {("serial", format(s, "x")) for s in current.serials} | {("sha256", f) for f in current.fingerprints}
        added: list[str] = []
        for kind, value, comment in entries:
            norm = normalise(kind, value)
            if (kind, norm) in have:
                continue
            have.add((kind, norm))
            note = " ".join(comment.split())
            added.append(f"{kind} {norm}" + (f"  # {note}" if note else ""))
        if added or not p.exists():
            if text and not text.endswith("\n"):
                text += "\n"
            if not text:
                text = "# llmgw revocation list: 'serial HEX' or 'sha256 HEX', one a line (docs/certificates.md)\n"
            write_atomic(p, (text + "".join(line + "\n" for line in added)).encode(), mode=PUBLIC_MODE)
        return added


class Revocations:
    """The list a process enforces, reloadable in place.

    Built at start, where a configured file that is missing or invalid is an
    error (``RevocationError``): a process told to refuse some certificates
    must not start refusing none.  ``reload`` (SIGHUP) swaps in the file's
    new contents, or keeps the running list and logs why when the file has
    become unreadable or invalid, for the same reason.
    """

    def __init__(self, path: str | os.PathLike[str] | None):
        self.path = None if path is None else str(path)
        self.current = RevocationList() if path is None else load_revocations(path)
        self._listeners: list[Callable[[], None]] = []

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every reload that put a new list in force (to act on open connections)."""
        self._listeners.append(listener)

    def reload(self) -> bool:
        """Re-read the file; False (the running list kept, the reason logged) when it cannot be used."""
        if self.path is None:
            return True
        try:
            new = load_revocations(self.path)
        except RevocationError as e:
            log.error("revocation list not reloaded, the running one (%d entries) stays in force: %s",
                      len(self.current), e)
            return False
        if new != self.current:
            log.info("revocation list %s reloaded: %d entries (was %d)", self.path, len(new), len(self.current))
            self.current = new
            for listener in self._listeners:
                listener()
        return True

    def check(self, identity: PeerIdentity) -> None:
        self.current.check(identity)
