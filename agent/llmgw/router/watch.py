"""Endpoint distribution from the control plane to standalone routers.

Long polling over plain HTTPS (mTLS): ``GET /v1/router/endpoints?after=REV``
answers at once when the table moved past ``REV``, otherwise after up to
30 s of waiting.  Every answer is the whole set, so a router that missed
updates or restarted is correct after one answer.  ``epoch`` identifies the
control plane process: after its restart revisions start over, and a
differing epoch makes the next poll answer at once.

The client keeps the last endpoints it received while the control plane is
unreachable: engines keep serving, and so does the router.

Route keys (what each replica's engine holds in its prefix cache, as the agents relay them:
``llmgw.controlplane.routekeys``) ride on the same poll for a router that asks for them with
``kv_after=REV&kv_epoch=E``: the answer adds ``route_keys``, the changes since ``REV`` (or every
replica's keys, ``full``, when the control plane's log no longer reaches back that far or its
epoch differs). A route-key change answers a waiting poll after ``KV_BATCH_S``, so a router
takes a batch of changes per request, not one request per change. A router that does not ask
gets the answer it always got, and a control plane that predates route keys answers without
them: the router's index then stays empty and it balances as before.

``from_zero`` (only when some deployment has ``autoscale.min: 0``) names the models that scale
to zero: a request for one with no endpoint is held while a replica starts, where a model the
answer does not name is unknown. A router that predates it ignores the key.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
from typing import Any, Mapping, Protocol, Sequence

import aiohttp
from aiohttp import web

from llmgw import compat
from llmgw.protocol import LEADER_EPOCH_HEADER, WATCH_PATH

from .endpoints import Endpoint, EndpointError, EndpointTable, EndpointURLError
from .kvindex import KVIndex, KVIndexError
from .errors import INVALID_REQUEST, RouterError

log = logging.getLogger("llmgw.router.watch")

WATCH_WAIT_S = 30.0
KV_BATCH_S = 0.25  # seconds a route-key change waits for others before it answers a poll
# Retry cap while the control plane is unreachable.  A restart takes seconds and the router
# keeps serving from what it knows meanwhile; the cost of a long cap is that the new control
# plane (and every replica it places) is seen that much later.  One GET every 1-2 s per router
# is nothing to a control plane, and the jitter still spreads routers apart.
WATCH_BACKOFF_MAX = 2.0

# Request key the API's authentication sets when the caller is a router identity:
# only then does the answer carry the engines' keys.
# (a typed RequestKey where aiohttp has them, 3.13 on; a plain string before)
REVEAL_KEYS = web.RequestKey("llmgw_reveal_engine_keys", bool) if hasattr(web, "RequestKey") \
    else "llmgw_reveal_engine_keys"

class RouteKeySource(Protocol):
    """The control plane's route-key book as the watch reads it (``controlplane.routekeys.RouteKeyBook``)."""

    epoch: str
    revision: int
    listeners: list

    def since(self, after: int, epoch: str | None) -> tuple[int, bool, list[dict[str, Any]]]: ...


class ChangeSignal:
    """Wakes the polls waiting on one event loop; called (on that loop) after every change."""

    def __init__(self) -> None:
        self._waiters: set[asyncio.Future[None]] = set()

    def __call__(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    async def wait(self, timeout: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        try:
            await compat.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            pass
        finally:
            self._waiters.discard(fut)


def endpoints_watch_handler(table: EndpointTable, wait_s: float = WATCH_WAIT_S,
                            route_keys: RouteKeySource | None = None, kv_batch_s: float = KV_BATCH_S):
    """aiohttp handler for ``GET /v1/router/endpoints?after=REV[&epoch=E]``.

    Mount it on an authenticated API: the answer names every engine URL, and
    carries each engine's key only when the API marked the request
    ``REVEAL_KEYS`` (a router certificate): an operator can read the set,
    not use the engines behind the router's back.
    """

    async def handler(request: web.Request) -> web.Response:
        raw = request.query.get("after", "-1")
        try:
            after = int(raw)
        except ValueError:
            return RouterError(400, f"after: expected an integer revision, got {raw!r}", INVALID_REQUEST,
                               "invalid_revision", "after").response()
        kv_after: int | None = None
        if route_keys is not None and "kv_after" in request.query:
            try:
                kv_after = int(request.query["kv_after"])
            except ValueError:
                return RouterError(400, f"kv_after: expected an integer revision, got {request.query['kv_after']!r}",
                                   INVALID_REQUEST, "invalid_revision", "kv_after").response()
        kv_epoch = request.query.get("kv_epoch")
        epoch = table.epoch
        kv_due = kv_after is not None and (kv_epoch != route_keys.epoch or route_keys.revision != kv_after)
        if request.query.get("epoch", epoch) != epoch or table.revision != after or kv_due:
            rev, eps = table.snapshot()
        elif kv_after is None:
            rev, eps = await table.wait_changed(after, wait_s)
        else:
            rev, eps = await _wait_either(table, after, kv_signal, wait_s, kv_batch_s)
        with_key = request.get(REVEAL_KEYS) is True
        doc: dict[str, Any] = {"revision": rev, "epoch": epoch, "endpoints": [e.to_dict(with_key) for e in eps]}
        if table.from_zero:  # only when some deployment scales to zero: the answer is as it was otherwise
            doc["from_zero"] = sorted(table.from_zero)
        if kv_after is not None:
            kv_rev, full, replicas = route_keys.since(kv_after, kv_epoch)
            doc["route_keys"] = {"epoch": route_keys.epoch, "revision": kv_rev, "full": full, "replicas": replicas}
        return web.json_response(doc)

    kv_signal = ChangeSignal()
    if route_keys is not None:
        route_keys.listeners.append(kv_signal)
    return handler


async def _wait_either(table: EndpointTable, after: int, signal: ChangeSignal, wait_s: float,
                       batch_s: float) -> tuple[int, list[Endpoint]]:
    """Wait for an endpoint change or a route-key change; the latter gathers others for ``batch_s``."""
    eps_task = asyncio.ensure_future(table.wait_changed(after, wait_s))
    kv_task = asyncio.ensure_future(signal.wait(wait_s))
    try:
        await asyncio.wait({eps_task, kv_task}, return_when=asyncio.FIRST_COMPLETED)
        if not eps_task.done():
            await asyncio.wait({eps_task}, timeout=batch_s)
    finally:
        for t in (eps_task, kv_task):
            t.cancel()
    return table.snapshot()


class WatchError(Exception):
    pass


def parse_watch_response(doc: Any) -> tuple[int, str, list[Endpoint]]:
    """Validate a watch answer; errors name the offending field."""
    if not isinstance(doc, Mapping):
        raise WatchError(f"expected a JSON object, got {type(doc).__name__}")
    rev = doc.get("revision")
    if not isinstance(rev, int) or isinstance(rev, bool):
        raise WatchError("/revision: expected an integer")
    epoch = doc.get("epoch", "")
    if not isinstance(epoch, str):
        raise WatchError("/epoch: expected a string")
    raw = doc.get("endpoints")
    if not isinstance(raw, list):
        raise WatchError("/endpoints: expected an array")
    eps = []
    seen: set[str] = set()
    for i, d in enumerate(raw):
        try:
            ep = Endpoint.from_dict(d, where=f"/endpoints/{i}")
        except EndpointURLError as e:
            # one endpoint the router cannot connect to: skip it, keep the others
            log.warning("endpoint watch: skipping an endpoint with an unusable URL: %s", e)
            continue
        except EndpointError as e:
            raise WatchError(str(e)) from None
        if ep.id in seen:
            raise WatchError(f"/endpoints/{i}/id: duplicate endpoint id {ep.id!r}")
        seen.add(ep.id)
        eps.append(ep)
    return rev, epoch, eps


MAX_FROM_ZERO = 10000  # served names in one answer's ``from_zero``: far above any catalog, a bound on a bad answer


def parse_from_zero(doc: Mapping[str, Any]) -> frozenset[str]:
    """The answer's ``from_zero`` (served names of deployments that scale to zero); none when absent
    (a control plane that predates it, or no such deployment). Errors name the offending field."""
    raw = doc.get("from_zero", [])
    if not isinstance(raw, list) or len(raw) > MAX_FROM_ZERO:
        raise WatchError(f"/from_zero: expected an array of at most {MAX_FROM_ZERO} model names")
    for i, name in enumerate(raw):
        if not isinstance(name, str) or not name or len(name) > 256:
            raise WatchError(f"/from_zero/{i}: expected a model name (a string of 1-256 characters)")
    return frozenset(raw)


def apply_route_keys(index: KVIndex, doc: Mapping[str, Any], eps: Sequence[Endpoint], now: float) -> None:
    """The answer's ``route_keys`` into ``index``; an answer without them (a control plane that
    predates route keys) only says the endpoints are current, and leaves the index to go stale."""
    raw = doc.get("route_keys")
    if raw is None:
        return
    before = index.revision
    try:
        index.apply(raw, now)
    except KVIndexError as e:
        raise WatchError(str(e)) from None
    if index.revision != before:
        log.debug("route keys at revision %d (%s): %d replica(s) changed", index.revision,
                  "full" if raw.get("full") else "changes", len(raw.get("replicas") or ()))
    index.forget_except({ep.replica_id or ep.id for ep in eps})


class LeaderTerms:
    """The highest control-plane leader term seen on a watch answer; a lower one is refused.

    A leader paused past its lease (then deposed) that wakes must not be
    believed about which engines exist.  Answers without the header (a
    control plane without ``ha``) pass.
    """

    def __init__(self) -> None:
        self.highest = 0

    def admit(self, value: str | None) -> None:
        if value is None:
            return
        try:
            term = int(value)
        except ValueError:
            raise WatchError(f"{LEADER_EPOCH_HEADER}: not an integer: {value[:40]!r}") from None
        if term < self.highest:
            raise WatchError(f"answer from a deposed control-plane leader (term {term}; term {self.highest} "
                             "leads now): ignored")
        self.highest = term


async def watch_endpoints(
    url: str | Sequence[str],
    ssl_context: ssl.SSLContext | None,
    headers: Mapping[str, str] | None,
    table: EndpointTable,
    *,
    backoff_initial: float = 0.5,
    backoff_max: float = WATCH_BACKOFF_MAX,
    kv_index: KVIndex | None = None,
) -> None:
    """Keep ``table`` equal to the control plane's endpoint set, forever.

    Errors (unreachable, bad answer) are logged and retried with jittered
    exponential backoff; the table keeps its last good content meanwhile.
    Cancel the task to stop.
    """
    targets = [u.rstrip("/") + WATCH_PATH for u in ((url,) if isinstance(url, str) else url)]
    turn = 0
    target = targets[0]
    terms = LeaderTerms()
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=WATCH_WAIT_S + 15)
    connector = aiohttp.TCPConnector(limit=2, ssl=ssl_context if ssl_context is not None else True)
    after, epoch = -1, ""
    delay = backoff_initial
    failing_since_logged = False
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=dict(headers or {})) as s:
        while True:
            try:
                params = {"after": str(after), "epoch": epoch}
                if kv_index is not None:
                    params.update(kv_after=str(kv_index.revision), kv_epoch=kv_index.epoch)
                async with s.get(target, params=params) as r:
                    if r.status != 200:
                        text = (await r.content.read(300)).decode("utf-8", "replace")
                        raise WatchError(f"HTTP {r.status}: {text}")
                    terms.admit(r.headers.get(LEADER_EPOCH_HEADER))
                    doc = await r.json(content_type=None)
                rev, new_epoch, eps = parse_watch_response(doc)
                from_zero = parse_from_zero(doc)
                if kv_index is not None:
                    apply_route_keys(kv_index, doc, eps, time.monotonic())  # the scorer's clock
                if (rev, new_epoch) != (after, epoch):
                    table.replace(eps, from_zero)
                    if after == -1 or failing_since_logged:
                        log.info("endpoint watch: %d endpoint(s) at revision %d from %s", len(eps), rev, target)
                    after, epoch = rev, new_epoch
                failing_since_logged = False
                delay = backoff_initial
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError, WatchError) as e:
                sleep = delay * random.uniform(0.5, 1.0)
                log.warning("endpoint watch %s failed (%s: %s); keeping %d known endpoint(s), retrying in %.1fs",
                            target, type(e).__name__, e, len(table.snapshot()[1]), sleep)
                failing_since_logged = True
                if len(targets) > 1:  # several control planes: ask the next (one stands by, or is gone)
                    turn = (turn + 1) % len(targets)
                    target = targets[turn]
                    after, epoch = -1, ""  # another process: its revisions are its own
                    if kv_index is not None:
                        kv_index.revision, kv_index.epoch = -1, ""
                await asyncio.sleep(sleep)
                delay = min(delay * 2, backoff_max)
