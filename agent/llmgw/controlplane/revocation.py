"""The control plane's side of the revocation list: refusing revoked clients and closing their streams.

Every request's client certificate is checked against the list after the
handshake and before anything is served (``checked_identity``): a revoked
admin certificate gets 403, a revoked node's stream is refused before the
upgrade, a revoked router's watch polls and ejection reports are refused.
A connection already open when the list changes is the case a handshake
check misses: an agent stream lives for days, so a reload closes, at once,
every stream opened with a certificate that is now revoked
(``close_revoked_streams``); keep-alive HTTP connections need nothing more
because each request is checked again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiohttp import web

from llmgw.tls import PeerIdentity, Revocations, peer_identity
from llmgw.tls.identity import IdentityError

log = logging.getLogger("llmgw.controlplane.revocation")

REVOCATIONS: web.AppKey[Revocations] = web.AppKey("llmgw_revocations", Revocations)
T = TypeVar("T")


class ReloadSignal:
    """Wakes whatever waits on a held request when the revocation list changed."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def fire(self) -> None:
        self.event.set()
        self.event = asyncio.Event()


RELOADED: web.AppKey[ReloadSignal] = web.AppKey("llmgw_revocations_reloaded", ReloadSignal)


def install(app: web.Application, revocations: Revocations) -> None:
    """Check ``revocations`` on every request of ``app``, and wake its held requests when it changes."""
    app[REVOCATIONS] = revocations
    app[RELOADED] = signal = ReloadSignal()
    revocations.subscribe(signal.fire)


async def unless_revoked(request: web.Request, answer: Awaitable[T], allowed: Callable[[], bool]) -> T | None:
    """``answer``'s result, or None as soon as a reload makes ``allowed()`` false (``answer`` then cancelled).

    For requests held open (a watch poll waits up to 30 s for a change): the
    per-request check has passed already, and a router revoked meanwhile must
    not be answered with engine keys when the poll completes.
    """
    signal = request.config_dict.get(RELOADED)
    poll = asyncio.ensure_future(answer)
    try:
        while True:
            if signal is None:
                return await poll
            waiter = asyncio.ensure_future(signal.event.wait())
            try:
                await asyncio.wait((poll, waiter), return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
            if poll.done():
                return poll.result()
            if not allowed():
                return None
    finally:
        poll.cancel()


def checked_identity(request: web.Request) -> PeerIdentity:
    """The verified client certificate's identity; ``RevokedError`` when it is on the list,
    ``IdentityError`` when there is none (or it cannot be parsed)."""
    ssl_object = request.transport.get_extra_info("ssl_object") if request.transport else None
    if ssl_object is None:
        raise IdentityError("the connection is not TLS")
    identity = peer_identity(ssl_object)
    revocations = request.config_dict.get(REVOCATIONS)
    if revocations is not None:
        revocations.check(identity)
    return identity


def close_revoked_streams(cp, revocations: Revocations) -> list[str]:
    """Close the stream of every node whose registration certificate is now revoked; the node ids closed."""
    closed = []
    current = revocations.current
    for node_id, session in list(cp.sessions.items()):
        rec = cp.nodes.get(node_id)
        cert = getattr(rec, "certificate", None)
        if not cert:
            continue
        try:
            serial = int(str(cert.get("serial", "")), 16)
        except ValueError:
            continue
        entry = current.match_values(serial, str(cert.get("fingerprint_sha256", "")))
        if entry is None:
            continue
        reason = f"its client certificate (serial {serial:x}) is revoked ({entry} is on the revocation list)"
        log.warning("closing the stream of %s: %s", node_id, reason)
        session.close(reason)
        closed.append(node_id)
    return closed
