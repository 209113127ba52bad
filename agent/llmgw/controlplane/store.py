"""What the control plane keeps across its own restarts: operator intent, its epoch, its secrets.

Everything the fleet can report back (nodes, shards, replicas, engine keys)
is still rebuilt from registrations: a stored row could say "running" about
a process that died.  What no agent can report is what an operator asked
for and what the control plane promised itself:

* **intent**: cordons and node drains (``cordoned`` / ``draining``), and
  replica drains still in progress.  Losing them on a restart would hand a
  node under maintenance new work, or put a drained replica back in service.
* **epoch**: every registration opens a new epoch, and an epoch handed out
  must never be handed out again, by this process or its successor, or a
  stale stream could pass for a current one.  Epochs are reserved in blocks
  (``EPOCH_BLOCK``): one durable write per block, not per registration, and
  a successor starts above the last block reserved, used or not.
* **secrets** (``grant-secret``): opaque bytes under a name, 0600 like a key.

Backends, one job each: ``MemoryBackend`` (no ``state_dir``: today's
behaviour, and a warning at start), ``DirBackend`` (``state_dir``: one file
per key, 0600 in a 0700 directory, written with ``llmgw.durable.write_atomic``
so a crash leaves the old value or the new one, never half), ``EtcdBackend``
(``ha``: shared by the control planes, each write fenced on leadership).  Every write is
made durable before the change it records takes effect, so a caller that got
an answer never loses what it asked for; a write that fails leaves memory as
it was and the caller is told.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from llmgw.durable import PRIVATE_MODE, write_atomic
from llmgw.protocol import Cordon

log = logging.getLogger("llmgw.controlplane.store")

PRIVATE_DIR = 0o700
EPOCH_BLOCK = 4096  # epochs reserved per durable write
INTENT_KEY = "intent.json"
EPOCH_KEY = "epoch.json"
GRANT_SECRET_KEY = "grant-secret"
CORDON_STATES = tuple(c.value for c in Cordon)
_KEY = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


class StoreError(Exception):
    """The store cannot be read or written; the message says what and where."""


class Backend(Protocol):
    """Bytes under short names; ``put`` returns only once the value is durable."""

    where: str  # for messages: "memory", a directory, an etcd endpoint

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, value: bytes) -> None: ...


def _check_key(key: str) -> str:
    if not _KEY.match(key):
        raise ValueError(f"not a store key: {key!r}")
    return key


class MemoryBackend:
    """Nothing survives the process: a control plane without ``state_dir``."""

    where = "memory"

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        return self._data.get(_check_key(key))

    def put(self, key: str, value: bytes) -> None:
        self._data[_check_key(key)] = bytes(value)


class DirBackend:
    """One 0600 file per key in a 0700 directory on the control-plane host."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.where = str(self.path)
        try:
            self.path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
            os.chmod(self.path, PRIVATE_DIR)  # an existing directory, or a umask, may have widened it
        except OSError as e:
            raise StoreError(f"state_dir {self.path}: {e.strerror or e}") from e

    def get(self, key: str) -> bytes | None:
        p = self.path / _check_key(key)
        try:
            mode = p.stat().st_mode
            data = p.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"{p}: {e.strerror or e}") from e
        if mode & 0o077:
            raise StoreError(f"{p} is accessible by group or others (mode {mode & 0o777:04o}); run: chmod 600 {p}")
        return data

    def put(self, key: str, value: bytes) -> None:
        p = self.path / _check_key(key)
        try:
            write_atomic(p, value, mode=PRIVATE_MODE)
        except OSError as e:
            raise StoreError(f"{p}: {e.strerror or e}") from e


class EtcdBackend:
    """Keys under ``<prefix>/store/`` in etcd; with ``fence``, a write lands only while we lead.

    ``fence`` returns the txn compares that hold only while this control
    plane leads (``Elector.fence``), or raises ``StoreError`` when it does not:
    a deposed leader that wakes cannot overwrite its successor's intent.
    Calls block for one etcd round trip (milliseconds): the store writes
    only on operators' actions and once per ``EPOCH_BLOCK`` registrations.
    """

    def __init__(self, etcd: Any, prefix: str, fence: Callable[[], list[dict[str, Any]]] | None = None):
        self.etcd = etcd
        self.prefix = prefix.rstrip("/") + "/store/"
        self.fence = fence
        self.where = f"etcd {', '.join(etcd.endpoints)} {self.prefix}"

    def get(self, key: str) -> bytes | None:
        from llmgw.controlplane.etcd import EtcdUnavailable

        try:
            kv = self.etcd.get(self.prefix + _check_key(key))
        except EtcdUnavailable as e:
            raise StoreError(f"{self.where}{key}: {e}") from e
        return None if kv is None else kv.value

    def put(self, key: str, value: bytes) -> None:
        from llmgw.controlplane.etcd import EtcdUnavailable

        compare = self.fence() if self.fence is not None else []
        try:
            ok, _ = self.etcd.txn(compare, [self.etcd.put_op(self.prefix + _check_key(key), value)])
        except EtcdUnavailable as e:
            raise StoreError(f"{self.where}{key}: {e}") from e
        if not ok:
            raise StoreError(f"{self.where}{key}: not written: this control plane no longer leads")


@dataclass
class Intent:
    """What operators asked for that no agent can report back."""

    cordons: dict[str, str] = field(default_factory=dict)  # node id -> a Cordon value
    drains: set[str] = field(default_factory=set)  # replica ids drained by an operator, until they are gone

    def to_json(self) -> bytes:
        return json.dumps({"version": 1, "cordons": dict(sorted(self.cordons.items())),
                           "drains": sorted(self.drains)}, indent=1).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes, where: str) -> "Intent":
        try:
            doc = json.loads(data)
        except ValueError as e:
            raise StoreError(f"{where}: not JSON ({e}); fix or remove it (cordons in it are lost if removed)") from e
        problems = _intent_problems(doc)
        if problems:
            raise StoreError(f"{where}: " + "; ".join(problems))
        return cls(dict(doc.get("cordons", {})), set(doc.get("drains", [])))


def _intent_problems(doc: Any) -> list[str]:
    if not isinstance(doc, dict):
        return ["/: not a mapping"]
    out = []
    if doc.get("version") != 1:
        out.append(f"/version: {doc.get('version')!r} is not 1 (written by another version?)")
    cordons = doc.get("cordons", {})
    if not isinstance(cordons, dict):
        out.append("/cordons: not a mapping")
    else:
        out += [f"/cordons/{k}: {v!r} is not one of {', '.join(CORDON_STATES)}"
                for k, v in cordons.items() if v not in CORDON_STATES]
    drains = doc.get("drains", [])
    if not isinstance(drains, list) or not all(isinstance(d, str) for d in drains):
        out.append("/drains: not a list of replica ids")
    return out


class ControlPlaneStore:
    """Intent, epochs and secrets over one backend; every change durable before it is applied."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.reload()

    def reload(self) -> None:
        """Read everything again: a control plane taking over leads from what its predecessor wrote."""
        data = self.backend.get(INTENT_KEY)
        self.intent = Intent() if data is None else Intent.from_json(data, f"{self.backend.where}/{INTENT_KEY}")
        self._epoch = self._reserved = self._read_epoch()

    @property
    def durable(self) -> bool:
        return not isinstance(self.backend, MemoryBackend)

    # ------------------------------------------------------------- intent
    def set_cordon(self, node_id: str, state: str | None) -> None:
        """Record a node's cordon; StoreError (and nothing changed) when it cannot be made durable."""
        if state is not None and state not in CORDON_STATES:
            raise ValueError(f"not a cordon state: {state!r}")
        cordons = dict(self.intent.cordons)
        if state is None:
            cordons.pop(node_id, None)
        else:
            cordons[node_id] = state
        self._save_intent(Intent(cordons, set(self.intent.drains)))

    def cordon_of(self, node_id: str) -> str | None:
        return self.intent.cordons.get(node_id)

    def add_drain(self, replica_id: str) -> None:
        self._save_intent(Intent(dict(self.intent.cordons), self.intent.drains | {replica_id}))

    def forget_drains(self, replica_ids: set[str]) -> None:
        if replica_ids & self.intent.drains:
            self._save_intent(Intent(dict(self.intent.cordons), self.intent.drains - replica_ids))

    def _save_intent(self, new: Intent) -> None:
        if new == self.intent:
            return
        self.backend.put(INTENT_KEY, new.to_json())
        self.intent = new

    # -------------------------------------------------------------- epoch
    def _read_epoch(self) -> int:
        data = self.backend.get(EPOCH_KEY)
        if data is None:
            return 0
        try:
            value = json.loads(data)["reserved"]
        except (ValueError, KeyError, TypeError) as e:
            raise StoreError(f"{self.backend.where}/{EPOCH_KEY}: no reserved epoch in it ({e}); remove it only "
                             "if no agent is connected to any control plane of this fleet") from e
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise StoreError(f"{self.backend.where}/{EPOCH_KEY}: /reserved: {value!r} is not a non-negative integer")
        return value

    @property
    def epoch(self) -> int:
        """The last epoch handed out (or, before the first, the floor this process starts above)."""
        return self._epoch

    def next_epoch(self) -> int:
        """A new epoch, above every epoch any earlier control plane on this store handed out."""
        if self._epoch >= self._reserved:
            reserved = self._epoch + EPOCH_BLOCK
            self.backend.put(EPOCH_KEY, json.dumps({"reserved": reserved}).encode() + b"\n")
            self._reserved = reserved
        self._epoch += 1
        return self._epoch

    # ------------------------------------------------------------ secrets
    def secret(self, name: str) -> bytes | None:
        return self.backend.get(name)

    def put_secret(self, name: str, value: bytes) -> None:
        self.backend.put(name, value)


def open_store(state_dir: str | None) -> ControlPlaneStore:
    """The store ``server.yaml`` asks for; StoreError when it cannot be opened or read."""
    if state_dir is None:
        log.warning("no state_dir in server.yaml: cordons, drains and the epoch live in memory only, so a "
                    "control-plane restart un-cordons every node; set state_dir to keep them")
        return ControlPlaneStore(MemoryBackend())
    store = ControlPlaneStore(DirBackend(state_dir))
    if store.intent.cordons or store.intent.drains:
        log.info("state_dir %s: %d cordon(s), %d replica drain(s) kept from before; epochs continue above %d",
                 state_dir, len(store.intent.cordons), len(store.intent.drains), store.epoch)
    return store
