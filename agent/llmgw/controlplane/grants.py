"""Grants: the control plane's signature on every shard it dispatches.

A node's certificate proves who is talking, not what it may claim.  Without
grants a restarted control plane would rebuild its book from whatever agents
report, so any node certificate could report a Ready shard of any replica,
pointing at any address, with any engine key, and be routed prompts.

So every ``start`` carries a grant: the replica, its slot, model and
profile, the node and rank it was placed on, when and by which control-plane
run it was issued, and a per-replica nonce, MAC'd (HMAC-SHA256) under a
secret only the control plane holds.  The agent keeps the grant with the
shard record and presents it back in ``register`` and ``shard_status``.  A
reported shard is adopted only when its grant verifies and says exactly what
the report says: this node, this replica, this rank, this model and profile.

The engine key is *derived* from the grant (``engine_key``): HMAC of the
replica id and nonce under the same secret, one key per replica shared by
its ranks.  A control plane that adopts a replica recomputes the key from
the grant and never takes it from the agent's word, so a node cannot point
routers at an engine that answers with a key of its own choosing.

Pure: no file, no clock.  The secret file is ``grantsecret``'s job.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

GRANT_VERSION = 1
NONCE_BYTES = 16
# Every field a grant carries besides its MAC, and the type each must have.
_FIELDS: dict[str, tuple[type, ...]] = {
    "v": (int,), "replica_id": (str,), "slot": (int, type(None)), "model": (str,), "profile": (str,),
    "node_id": (str,), "rank": (int,), "nnodes": (int,), "issued_at": (int,), "cp_epoch": (int,),
    "nonce": (str,),
}


@dataclass(frozen=True)
class GrantKeys:
    """The grant secrets in force: the first signs, every one verifies (rotation)."""

    secrets: tuple[bytes, ...] = field(repr=False)  # never printed, never logged
    ephemeral: bool = False  # made up at start: grants do not outlive this process

    def __post_init__(self) -> None:
        if not self.secrets:
            raise ValueError("at least one grant secret is needed")

    @property
    def signing(self) -> bytes:
        return self.secrets[0]

    @classmethod
    def fresh(cls) -> "GrantKeys":
        return cls((secrets.token_bytes(32),), ephemeral=True)


@dataclass(frozen=True)
class Verdict:
    """Whether a presented grant holds; ``secret`` is the one that verified it."""

    ok: bool
    reason: str
    secret: bytes | None = None


@dataclass(frozen=True)
class Claim:
    """What a report says about one shard: a grant must say the same."""

    node_id: str
    replica_id: str
    rank: int
    nnodes: int
    model: str
    profile: str


def new_nonce() -> str:
    """A replica's nonce: shared by its ranks' grants, the salt of its engine key."""
    return secrets.token_hex(NONCE_BYTES)


def _mac(secret: bytes, body: dict[str, Any]) -> str:
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return hmac.new(secret, b"llmgw-grant\0" + canon, hashlib.sha256).hexdigest()


def issue(keys: GrantKeys, *, replica_id: str, slot: int | None, model: str, profile: str, node_id: str,
          rank: int, nnodes: int, issued_at: float, cp_epoch: int, nonce: str) -> dict[str, Any]:
    """A grant for one shard, signed with the current secret (a plain dict: it travels in the spec)."""
    body: dict[str, Any] = {"v": GRANT_VERSION, "replica_id": replica_id, "slot": slot, "model": model,
                            "profile": profile, "node_id": node_id, "rank": rank, "nnodes": nnodes,
                            "issued_at": int(issued_at), "cp_epoch": cp_epoch, "nonce": nonce}
    return {**body, "mac": _mac(keys.signing, body)}


def verify(keys: GrantKeys, grant: Any, claim: Claim) -> Verdict:
    """Whether ``grant`` was issued by this control plane's secret for exactly ``claim``.

    The reason names what failed, for ``ctl replicas``/``explain`` and the log;
    it never contains a secret or a MAC.
    """
    if grant is None:
        return Verdict(False, "no grant: never placed by a control plane that signs grants")
    if not isinstance(grant, dict) or not isinstance(grant.get("mac"), str):
        return Verdict(False, "malformed grant (no MAC)")
    body = {k: v for k, v in grant.items() if k != "mac"}
    if set(body) != set(_FIELDS):
        return Verdict(False, "malformed grant (unexpected or missing fields)")
    for name, types in _FIELDS.items():
        value = body[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            return Verdict(False, f"malformed grant ({name} has the wrong type)")
    if body["v"] != GRANT_VERSION:
        return Verdict(False, f"grant version {body['v']} is not {GRANT_VERSION}")
    secret = next((s for s in keys.secrets if hmac.compare_digest(_mac(s, body), grant["mac"])), None)
    if secret is None:
        return Verdict(False, "grant does not verify under this control plane's grant key "
                              "(issued under another key, or the key was lost or replaced)")
    for name, want in (("node_id", claim.node_id), ("replica_id", claim.replica_id), ("rank", claim.rank),
                       ("nnodes", claim.nnodes), ("model", claim.model), ("profile", claim.profile)):
        if body[name] != want:
            what = "node" if name == "node_id" else name.replace("_id", "")
            return Verdict(False, f"grant is for {what} {body[name]!r}, the report says {want!r}")
    return Verdict(True, "granted", secret)


def engine_key(secret: bytes, replica_id: str, nonce: str) -> str:
    """The replica's engine key: the same for all its ranks, recomputable from its grant.

    256 bits, URL-safe (fits an HTTP header as is).  Derived under the secret
    that signed the grant, so rotating the signing secret leaves the keys of
    running engines unchanged while the old secret still verifies.
    """
    digest = hmac.new(secret, b"llmgw-engine-key\0" + replica_id.encode() + b"\0" + nonce.encode(),
                      hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
