"""Endpoint distribution from the control plane to standalone routers.

Long polling over plain HTTPS (mTLS): ``GET /v1/router/endpoints?after=REV``
answers at once when the table moved past ``REV``, otherwise after up to
30 s of waiting.  Every answer is the whole set, so a router that missed
updates or restarted is correct after one answer.  ``epoch`` identifies the
control plane process: after its restart revisions start over, and a
differing epoch makes the next poll answer at once.

The client keeps the last endpoints it received while the control plane is
unreachable: engines keep serving, and so does the router.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from typing import Any, Mapping, Sequence

import aiohttp
from aiohttp import web

from llmgw.protocol import LEADER_EPOCH_HEADER, WATCH_PATH

from .endpoints import Endpoint, EndpointError, EndpointTable, EndpointURLError
from .errors import INVALID_REQUEST, RouterError

log = logging.getLogger("llmgw.router.watch")

WATCH_WAIT_S = 30.0
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

def endpoints_watch_handler(table: EndpointTable, wait_s: float = WATCH_WAIT_S):
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
        epoch = table.epoch
        if request.query.get("epoch", epoch) != epoch or table.revision != after:
            rev, eps = table.snapshot()
        else:
            rev, eps = await table.wait_changed(after, wait_s)
        with_key = request.get(REVEAL_KEYS) is True
        return web.json_response({"revision": rev, "epoch": epoch,
                                  "endpoints": [e.to_dict(with_key) for e in eps]})

    return handler


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
                async with s.get(target, params={"after": str(after), "epoch": epoch}) as r:
                    if r.status != 200:
                        text = (await r.content.read(300)).decode("utf-8", "replace")
                        raise WatchError(f"HTTP {r.status}: {text}")
                    terms.admit(r.headers.get(LEADER_EPOCH_HEADER))
                    doc = await r.json(content_type=None)
                rev, new_epoch, eps = parse_watch_response(doc)
                if (rev, new_epoch) != (after, epoch):
                    table.replace(eps)
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
                await asyncio.sleep(sleep)
                delay = min(delay * 2, backoff_max)
