"""Bearer API keys, stored only as SHA-256 digests.

A key is looked up by the digest of what the client sent, so the router
never holds a usable key and a config file leak does not leak access.
Keys are high-entropy secrets, which is why an unsalted hash is enough
(a salt protects guessable passwords, not random tokens).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable

from .settings import ApiKey


def hash_key(key: str) -> str:
    """The digest to put in ``api_keys[].sha256`` (same as ``printf %s KEY | sha256sum``)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who is calling: a configured key, or the anonymous caller of an open router."""

    name: str
    models: frozenset[str] | None  # None: every model

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


ANONYMOUS = Principal("-", None)


class AuthFailure(Exception):
    """Missing or unknown key; the message is safe to show the caller."""


class KeyRing:
    def __init__(self, keys: Iterable[ApiKey], allow_unauthenticated: bool) -> None:
        self.replace(keys, allow_unauthenticated)

    def replace(self, keys: Iterable[ApiKey], allow_unauthenticated: bool) -> None:
        """Put another set of keys in force (a reload); requests already admitted keep their principal."""
        self._by_hash = {k.sha256: Principal(k.name, k.models) for k in keys}
        self._open = allow_unauthenticated

    def authenticate(self, authorization: str | None) -> Principal:
        """Map an ``Authorization`` header value to a principal or raise ``AuthFailure``.

        An open router (``allow_unauthenticated``) checks nothing: SDK clients
        always send some key, often a placeholder, and all of them are served
        for every model.  A known key then only names the caller in the log.
        """
        if not authorization:
            if self._open:
                return ANONYMOUS
            raise AuthFailure("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            if self._open:
                return ANONYMOUS
            raise AuthFailure("malformed Authorization header: expected 'Bearer <key>'")
        principal = self._by_hash.get(hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest())
        if self._open:
            return ANONYMOUS if principal is None else Principal(principal.name, None)
        if principal is None:
            raise AuthFailure("invalid API key")
        return principal
