"""The agent's state directory: one record per shard, and the engines' logs.

The control plane persists nothing dynamic; after any restart the fleet is
authoritative about what runs.  For the agent to describe an engine it did
not start in this life (it was restarted, or killed), it must find on disk
everything needed to match that engine to a replica: the full shard spec,
not just a pid and a command line, plus the process identity (pid, start
time, boot id) that proves the pid still names the same process.

Layout::

    <state_dir>/shards/<shard>.json   ShardRecord, 0600, written atomically
    <state_dir>/logs/<shard>.log      engine stdout+stderr only, appended across lives
    <state_dir>/logs/<shard>.agent.log the agent's notes about that engine (launch, adoption, exit)
    <state_dir>/secrets/<shard>/      0700: files holding the engine key (SGLang's --config)
    <state_dir>/kv/<12 hex digits>/   0700: the unix sockets the engine binds (vLLM's KV events)

A record holds the shard spec, engine key included: it is how the key
survives an agent restart (adoption reports it back), so records stay 0600
in a 0700 directory.

Records are written to a temp file beside the target, fsynced, renamed over
it, and the directory fsynced: a crash leaves the old record or the new one,
never half of one, and a record that says a process was launched survives a
power cut along with the process's absence (the boot id then disagrees).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote, unquote

from llmgw.agent.procident import ProcessIdentity
from llmgw.durable import fsync_dir, write_atomic

log = logging.getLogger(__name__)

RECORD_VERSION = 1
PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700


@dataclass(frozen=True)
class ShardRecord:
    """What the agent knows about one shard it launched.

    ``spec`` is the shard spec exactly as the control plane sent it (the
    stream schema's ``shard_spec``), so a later agent can report it back
    verbatim.  ``start_deadline`` is a CLOCK_MONOTONIC time: that clock is
    system-wide and survives agent restarts within one boot, so adopting a
    still-starting engine keeps its original deadline rather than granting it
    a fresh ``start_timeout``.
    """

    spec: dict[str, Any]
    state: str
    process: ProcessIdentity | None = None
    port: int | None = None
    master_port: int | None = None
    address: str | None = None
    started_at: float | None = None  # wall clock, when the start was accepted
    start_deadline: float | None = None  # time.monotonic() value, while starting
    argv: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def shard_id(self) -> str:
        return str(self.spec["shard_id"])

    def with_(self, **changes: Any) -> "ShardRecord":
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": RECORD_VERSION,
            "spec": self.spec,
            "state": self.state,
            "process": self.process.to_dict() if self.process else None,
            "port": self.port,
            "master_port": self.master_port,
            "address": self.address,
            "started_at": self.started_at,
            "start_deadline": self.start_deadline,
            "argv": list(self.argv),
            "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ShardRecord":
        if d.get("version") != RECORD_VERSION:
            raise ValueError(f"record version {d.get('version')!r}, this agent reads {RECORD_VERSION}")
        spec = d["spec"]
        if not isinstance(spec, dict) or not isinstance(spec.get("shard_id"), str):
            raise ValueError("spec is not a shard spec (no shard_id)")
        proc = d.get("process")
        return cls(
            spec=spec,
            state=str(d["state"]),
            process=ProcessIdentity.from_dict(proc) if proc else None,
            port=d.get("port"),
            master_port=d.get("master_port"),
            address=d.get("address"),
            started_at=d.get("started_at"),
            start_deadline=d.get("start_deadline"),
            argv=tuple(d.get("argv", ())),
            extra=dict(d.get("extra", {})),
        )


@dataclass(frozen=True)
class UnreadableRecord:
    """A file in shards/ that is not a record this agent can use, and why."""

    path: Path
    reason: str


def _file_name(shard_id: str) -> str:
    # Shard ids contain "/" (replica/r0) and ":"; percent-encode everything
    # that is not plainly safe in a file name so the mapping is reversible.
    return quote(shard_id, safe="")


def socket_dir(root: Path, shard_id: str) -> Path:
    """The shard's 0700 directory for the unix sockets its engine binds (KV events), created.

    Named by the first 12 hex digits of the shard id's SHA-256, not by the id itself: shard
    ids carry model and profile names of any length, and a unix socket path holds 107 bytes.
    """
    d = _socket_dir_path(root, shard_id)
    for p in (d.parent, d):
        p.mkdir(mode=PRIVATE_DIR, exist_ok=True)
        os.chmod(p, PRIVATE_DIR)
    return d


def _socket_dir_path(root: Path, shard_id: str) -> Path:
    return root / "kv" / hashlib.sha256(shard_id.encode()).hexdigest()[:12]


class ShardStore(Protocol):
    """What the supervisor and its engine drivers need of a state directory, by shard id.

    ``StateDir`` is the agent's; the fleet simulator's ``SimStateDir`` keeps
    nothing for simulated shards.  Both subclass this protocol, so a method the
    supervisor starts calling, or a keyword it starts passing, is one both must
    have (``tests/unit/test_agent_driver_seam.py`` compares the signatures): a
    duck-typed copy fails only when a rare path first reaches it.
    """

    root: Path  # the directory engines run in

    def write(self, record: ShardRecord) -> None:
        """Persist ``record``, replacing the shard's previous one, before returning."""
        ...

    def remove(self, shard_id: str) -> None:
        ...

    def secret_dir(self, shard_id: str) -> Path:
        """The shard's private (0700) directory for key files."""
        ...

    def remove_secrets(self, shard_id: str) -> None:
        ...

    def open_log(self, shard_id: str) -> int:
        """An append-only fd for the engine's stdout and stderr (the caller closes it)."""
        ...

    def log_note(self, shard_id: str, line: str) -> None:
        """One line of the agent's own about the shard, kept apart from the engine's output."""
        ...

    def log_tail(self, shard_id: str, max_bytes: int = 16384, since_offset: int | None = None,
                 since_marker: str | None = None) -> str:
        """The end of the engine's output in this life."""
        ...


class StateDir(ShardStore):
    """Shard records and engine logs under one directory (created 0700)."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        self.shards_dir = self.root / "shards"
        self.logs_dir = self.root / "logs"
        self.secrets_dir = self.root / "secrets"
        for d in (self.root, self.shards_dir, self.logs_dir, self.secrets_dir):
            d.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
            os.chmod(d, PRIVATE_DIR)

    def record_path(self, shard_id: str) -> Path:
        return self.shards_dir / f"{_file_name(shard_id)}.json"

    def log_path(self, shard_id: str) -> Path:
        return self.logs_dir / f"{_file_name(shard_id)}.log"

    def notes_path(self, shard_id: str) -> Path:
        return self.logs_dir / f"{_file_name(shard_id)}.agent.log"

    def log_size(self, shard_id: str) -> int:
        """Bytes in the engine's log now: where the output of an engine launched next begins."""
        try:
            return self.log_path(shard_id).stat().st_size
        except FileNotFoundError:
            return 0

    def secret_dir(self, shard_id: str) -> Path:
        """The shard's private directory for key files, created 0700."""
        d = self.secrets_dir / _file_name(shard_id)
        d.mkdir(mode=PRIVATE_DIR, exist_ok=True)
        os.chmod(d, PRIVATE_DIR)
        return d

    def remove_secrets(self, shard_id: str) -> None:
        """The shard's key files and its socket directory (a socket an engine killed outright leaves)."""
        for d in (self.secrets_dir / _file_name(shard_id), _socket_dir_path(self.root, shard_id)):
            if not d.is_dir():
                continue
            for f in d.iterdir():
                f.unlink(missing_ok=True)
            d.rmdir()

    def write(self, record: ShardRecord) -> None:
        data = json.dumps(record.to_dict(), indent=1, sort_keys=True).encode()
        write_atomic(self.record_path(record.shard_id), data, mode=PRIVATE_FILE)

    def remove(self, shard_id: str) -> None:
        try:
            self.record_path(shard_id).unlink()
        except FileNotFoundError:
            return
        fsync_dir(self.shards_dir)

    def remove_path(self, path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            return
        fsync_dir(self.shards_dir)

    def load(self) -> tuple[list[ShardRecord], list[UnreadableRecord]]:
        """Every record, plus every file that could not be used as one (with the reason).

        A leftover temp file from a write interrupted by a crash is reported
        as unreadable so the caller removes it; it never shadows the record.
        """
        records: list[ShardRecord] = []
        bad: list[UnreadableRecord] = []
        for path in sorted(self.shards_dir.iterdir()):
            if not path.name.endswith(".json") or path.name.startswith("."):
                bad.append(UnreadableRecord(path, "not a shard record (interrupted write or stray file)"))
                continue
            try:
                rec = ShardRecord.from_dict(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError, TypeError) as e:
                bad.append(UnreadableRecord(path, f"unreadable record: {e}"))
                continue
            if unquote(path.name.removesuffix(".json")) != rec.shard_id:
                bad.append(UnreadableRecord(path, f"file name does not match shard id {rec.shard_id!r}"))
                continue
            records.append(rec)
        return records, bad

    def open_log(self, shard_id: str) -> int:
        """An O_APPEND fd on the shard's log, for the engine's stdout and stderr.

        Append mode matters twice: an adopted engine keeps writing through
        its own fd across agent restarts, and a relaunch of the same shard
        keeps the previous life's output readable above it.
        """
        return os.open(self.log_path(shard_id), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                       PRIVATE_FILE)

    def log_note(self, shard_id: str, line: str) -> None:
        """Append one agent-authored line to the shard's notes, never to the engine's log.

        Notes written while an engine runs (one per adoption, every agent
        restart) would otherwise land among its output, and the tail sent
        when it dies would show them instead of the engine's last words.
        """
        fd = os.open(self.notes_path(shard_id), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                     PRIVATE_FILE)
        try:
            os.write(fd, f"=== llmgw-agent: {line}\n".encode())
        finally:
            os.close(fd)

    def log_tail(self, shard_id: str, max_bytes: int = 16384, since_offset: int | None = None,
                 since_marker: str | None = None) -> str:
        """The last ``max_bytes`` of the engine's log, decoded leniently.

        With ``since_offset`` (the log's size when the engine was launched),
        only this life's output, so a failure report never shows an earlier
        run's output as if it were this one's; a log shorter than the offset
        was truncated (rotated) and is read whole.  ``since_marker`` does the
        same for engines launched by an agent that still wrote its launch line
        into the engine's log: only what follows the last line containing it.
        """
        path = self.log_path(shard_id)
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                start = since_offset if since_offset is not None and since_offset <= size else 0
                f.seek(max(start, size - max_bytes))
                data = f.read()
        except OSError:
            return ""
        text = data.decode("utf-8", "replace")
        if since_marker:
            idx = text.rfind(since_marker)
            if idx >= 0:
                nl = text.find("\n", idx)
                text = text[nl + 1 :] if nl >= 0 else ""
        return text
