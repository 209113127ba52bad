"""The set of endpoints the router may send traffic to.

The control plane owns the truth (which replicas are Ready, which drain) and
pushes it with ``EndpointTable.replace``; the data path only reads.  Reads are
a single attribute load of an immutable snapshot, so the hot path never takes
a lock; writers may live on another thread or another event loop.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping
from urllib.parse import urlsplit

from llmgw import compat


ROLES = ("both", "prefill", "decode")


class EndpointError(ValueError):
    """An endpoint description that cannot be routed to; the message names the field."""


class EndpointURLError(EndpointError):
    """The endpoint's URL cannot be connected to (scheme, host, port, query)."""


@dataclass(frozen=True)
class Endpoint:
    """One engine HTTP server (a replica's rank 0) serving one model name."""

    id: str
    model: str  # the served model name clients put in "model"
    url: str  # "http://10.0.0.5:8000"; a path prefix is kept
    replica_id: str = ""
    draining: bool = False  # receives nothing new, finishes what it has
    max_concurrency: int | None = None  # None: the router's default limit
    # The replica's engine key, sent upstream as "Authorization: Bearer"; never
    # printed (repr) and only in the watch answer given to a router identity.
    api_key: str | None = field(default=None, repr=False)
    # A disaggregated model's endpoints: "prefill" only computes prompts for decoders
    # (router/prefill.py), "decode" and "both" take the model's requests.
    role: str = "both"
    # An SGLang prefill endpoint's bootstrap server (on the URL's host): a request of its model goes to it and
    # to a decoder at once, both naming it and one room (router/dualdispatch.py); None: vLLM's two phases.
    bootstrap_port: int | None = None
    # A decode endpoint that cannot compute a prompt itself (SGLang's decode mode): without a prefill endpoint
    # its model cannot be served, where vLLM's decoders prefill locally.
    requires_prefill: bool = False
    # Scale to sleep: the engine is asleep (docs/autoscaling.md); it takes nothing until it wakes,
    # and a request for a model whose endpoints all sleep waits in the hold queue (router/holdqueue.py).
    sleeping: bool = False

    def __post_init__(self) -> None:
        if not self.id:
            raise EndpointError("id: must be a non-empty string")
        if not self.model:
            raise EndpointError(f"endpoint {self.id!r}: model: must be a non-empty string")
        try:
            parts = urlsplit(self.url)
            port = parts.port  # raises ValueError when out of range or not a number
        except ValueError as e:
            raise EndpointURLError(f"endpoint {self.id!r}: url: {self.url!r} is not a valid URL ({e})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EndpointURLError(f"endpoint {self.id!r}: url: {self.url!r} is not an http(s) URL with a host")
        if port == 0:
            raise EndpointURLError(f"endpoint {self.id!r}: url: {self.url!r}: port 0 cannot be connected to")
        if parts.query or parts.fragment:
            raise EndpointURLError(f"endpoint {self.id!r}: url: {self.url!r} must not carry a query or fragment")
        if self.max_concurrency is not None and (
            not isinstance(self.max_concurrency, int) or isinstance(self.max_concurrency, bool) or self.max_concurrency < 1
        ):
            raise EndpointError(f"endpoint {self.id!r}: max_concurrency: must be a positive integer")
        if self.role not in ROLES:
            raise EndpointError(f"endpoint {self.id!r}: role: must be one of {', '.join(ROLES)}")
        if self.bootstrap_port is not None and (
            not isinstance(self.bootstrap_port, int) or isinstance(self.bootstrap_port, bool)
            or not 1 <= self.bootstrap_port <= 65535 or self.role != "prefill"
        ):
            raise EndpointError(f"endpoint {self.id!r}: bootstrap_port: must be a port number (1-65535), "
                                "and only on a prefill endpoint")
        if self.requires_prefill and self.role != "decode":
            raise EndpointError(f"endpoint {self.id!r}: requires_prefill: only on a decode endpoint")

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/")

    def to_dict(self, with_key: bool = False) -> dict[str, Any]:
        """The JSON form; the engine key only with ``with_key`` (a router identity asked)."""
        d: dict[str, Any] = {
            "id": self.id,
            "model": self.model,
            "url": self.url,
            "replica_id": self.replica_id,
            "draining": self.draining,
            "max_concurrency": self.max_concurrency,
        }
        if with_key and self.api_key:
            d["api_key"] = self.api_key
        if self.role != "both":  # only when set: a router that predates roles refuses the key
            d["role"] = self.role
        if self.bootstrap_port is not None:  # likewise
            d["bootstrap_port"] = self.bootstrap_port
        if self.requires_prefill:  # likewise
            d["requires_prefill"] = True
        if self.sleeping:  # only when set, likewise
            d["sleeping"] = True
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "endpoint") -> "Endpoint":
        """Build from a JSON object (watch API, static config); errors name ``where``."""
        if not isinstance(d, Mapping):
            raise EndpointError(f"{where}: expected an object, got {type(d).__name__}")
        unknown = set(d) - {"id", "model", "url", "replica_id", "draining", "max_concurrency", "api_key", "role",
                          "sleeping", "bootstrap_port", "requires_prefill"}
        if unknown:
            raise EndpointError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
        for key in ("model", "url"):
            if not isinstance(d.get(key), str):
                raise EndpointError(f"{where}/{key}: required string")
        for key in ("id", "replica_id"):
            if key in d and not isinstance(d[key], str):
                raise EndpointError(f"{where}/{key}: must be a string")
        api_key = d.get("api_key")
        if api_key is not None and (not isinstance(api_key, str) or not api_key or not api_key.isascii()
                                    or not api_key.isprintable() or " " in api_key):
            raise EndpointError(f"{where}/api_key: must be a non-empty string of printable ASCII without spaces")
        if "role" in d and d["role"] not in ROLES:
            raise EndpointError(f"{where}/role: must be one of {', '.join(ROLES)}")
        if "draining" in d and not isinstance(d["draining"], bool):
            raise EndpointError(f"{where}/draining: must be a boolean")
        for key in ("sleeping", "requires_prefill"):
            if key in d and not isinstance(d[key], bool):
                raise EndpointError(f"{where}/{key}: must be a boolean")
        mc = d.get("max_concurrency")
        if mc is not None and (not isinstance(mc, int) or isinstance(mc, bool)):
            raise EndpointError(f"{where}/max_concurrency: must be an integer or null")
        bp = d.get("bootstrap_port")
        if bp is not None and (not isinstance(bp, int) or isinstance(bp, bool)):
            raise EndpointError(f"{where}/bootstrap_port: must be an integer")
        try:
            return cls(
                id=d.get("id") or f"{d['model']}@{d['url']}",
                model=d["model"],
                url=d["url"],
                replica_id=d.get("replica_id", ""),
                draining=d.get("draining", False),
                max_concurrency=mc,
                api_key=api_key,
                role=d.get("role", "both"),
                bootstrap_port=bp,
                requires_prefill=d.get("requires_prefill", False),
                sleeping=d.get("sleeping", False),
            )
        except EndpointError as e:
            raise type(e)(f"{where}: {e}") from None


@dataclass(frozen=True)
class _Snapshot:
    revision: int
    endpoints: tuple[Endpoint, ...]
    by_model: Mapping[str, tuple[Endpoint, ...]]
    # served names of deployments that scale to zero (autoscale min 0): a request for one with no
    # endpoint is held while a replica starts (router/holdqueue.py), not answered "no such model"
    from_zero: frozenset[str] = frozenset()


class EndpointTable:
    """Atomically replaced endpoint set with a revision and change notification.

    ``replace`` may be called from any thread; ``wait_changed`` may be awaited
    from any event loop (each waiter is woken on its own loop).
    """

    def __init__(self, endpoints: list[Endpoint] | tuple[Endpoint, ...] = ()) -> None:
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._snap = self._build(0, tuple(endpoints), frozenset())
        # Identifies this table for its lifetime: after a control-plane restart
        # revisions start over, and watchers must not mistake an old number for news.
        self.epoch = secrets.token_hex(8)

    @staticmethod
    def _build(revision: int, endpoints: tuple[Endpoint, ...], from_zero: frozenset[str]) -> _Snapshot:
        seen: set[str] = set()
        by_model: dict[str, list[Endpoint]] = {}
        for ep in endpoints:
            if not isinstance(ep, Endpoint):
                raise TypeError(f"expected Endpoint, got {type(ep).__name__}")
            if ep.id in seen:
                raise EndpointError(f"duplicate endpoint id {ep.id!r}")
            seen.add(ep.id)
            by_model.setdefault(ep.model, []).append(ep)
        return _Snapshot(
            revision,
            endpoints,
            MappingProxyType({m: tuple(v) for m, v in by_model.items()}),
            from_zero,
        )

    @property
    def revision(self) -> int:
        return self._snap.revision

    def replace(self, endpoints: list[Endpoint] | tuple[Endpoint, ...], from_zero: Iterable[str] = ()) -> int:
        """Set the whole endpoint set (and the models that scale from zero) at once; returns the new
        revision.

        Raises (and changes nothing) on duplicate ids, so a bad update never
        half-applies.
        """
        with self._lock:
            snap = self._build(self._snap.revision + 1, tuple(endpoints), frozenset(from_zero))
            self._snap = snap
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_wake, fut)
            except RuntimeError:  # that loop is closed; its waiter is gone with it
                pass
        return snap.revision

    def for_model(self, name: str) -> tuple[Endpoint, ...]:
        return self._snap.by_model.get(name, ())

    def models(self) -> list[str]:
        """Model names with at least one endpoint (draining included)."""
        return sorted(self._snap.by_model)

    @property
    def from_zero(self) -> frozenset[str]:
        """Served names of the deployments that scale to zero, as of this revision."""
        return self._snap.from_zero

    def snapshot(self) -> tuple[int, list[Endpoint]]:
        snap = self._snap
        return snap.revision, list(snap.endpoints)

    def snapshot_from_zero(self) -> tuple[int, list[Endpoint], frozenset[str]]:
        """``snapshot`` and the models that scale from zero, of one revision."""
        snap = self._snap
        return snap.revision, list(snap.endpoints), snap.from_zero

    async def wait_changed(self, after_revision: int, timeout: float | None) -> tuple[int, list[Endpoint]]:
        """Return the snapshot as soon as its revision exceeds ``after_revision``.

        On timeout the current snapshot is returned anyway; callers compare
        the revision to tell a change from a timeout.
        """
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._snap.revision > after_revision:
                return self.snapshot()
            fut: asyncio.Future[None] = loop.create_future()
            entry = (loop, fut)
            self._waiters.append(entry)
        try:
            await compat.wait_for(asyncio.shield(fut), timeout)
        except (TimeoutError, asyncio.TimeoutError):
            pass
        finally:
            with self._lock:
                try:
                    self._waiters.remove(entry)
                except ValueError:
                    pass
        return self.snapshot()


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
