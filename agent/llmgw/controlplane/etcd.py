"""etcd v3 over its gRPC gateway's JSON (``/v3/...``), with the HTTP client llmgw already has.

Why not a client library: the maintained Python etcd clients lag etcd or pull
in grpc; what the control plane needs (a lease, its keep-alive, a
compare-and-put, a read) is five JSON calls, about 2.5 ms each on loopback.

Keys and values travel base64-encoded; 64-bit integers as JSON strings;
fields at their zero value are left out of answers (a failed txn has no
``succeeded``, an empty range no ``kvs``, an expired lease's keep-alive no
``TTL``).  The clients try the configured endpoints in turn, each for at
most ``timeout``, and stick to the last one that answered; the lease's
renewals are hedged across them (``AsyncEtcd``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
from dataclasses import dataclass
from typing import Any

import httpx


class EtcdUnavailable(Exception):
    """No endpoint answered, or the answer was an error; the message says which and why."""


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


def b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _kv(d: dict[str, Any]) -> KeyValue:
    return KeyValue(base64.b64decode(d["key"]).decode(), base64.b64decode(d.get("value", "")),
                    int(d.get("create_revision", 0)), int(d.get("mod_revision", 0)), int(d.get("lease", 0)))


def tls_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """A client context for https:// endpoints: the etcd CA, and our certificate when etcd asks for one."""
    if ca is None:
        return None
    ctx = ssl.create_default_context(cafile=ca)
    if cert and key:
        ctx.load_cert_chain(cert, key)
    return ctx


class _Calls:
    """The request bodies and answer parsing, shared by the blocking and the asyncio client."""

    @staticmethod
    def txn_body(compare: list[dict[str, Any]], success: list[dict[str, Any]],
                 failure: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {"compare": compare, "success": success, "failure": failure or []}

    @staticmethod
    def put_op(key: str, value: bytes, lease: int = 0) -> dict[str, Any]:
        op: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            op["lease"] = str(lease)
        return {"request_put": op}

    @staticmethod
    def range_op(key: str) -> dict[str, Any]:
        return {"request_range": {"key": b64(key)}}

    @staticmethod
    def first_kv(answer: dict[str, Any]) -> KeyValue | None:
        kvs = answer.get("kvs") or []
        return _kv(kvs[0]) if kvs else None

    @staticmethod
    def txn_ranges(answer: dict[str, Any]) -> list[KeyValue | None]:
        out: list[KeyValue | None] = []
        for r in answer.get("responses") or []:
            if "response_range" in r:
                out.append(_Calls.first_kv(r["response_range"]))
        return out


def _check(endpoint: str, path: str, r: httpx.Response) -> dict[str, Any]:
    try:
        doc = r.json()
    except ValueError:
        doc = None
    if r.status_code != 200 or not isinstance(doc, dict):
        raise EtcdUnavailable(f"{endpoint}{path}: HTTP {r.status_code}: {r.text[:200]}")
    if "error" in doc and "result" not in doc:
        raise EtcdUnavailable(f"{endpoint}{path}: {doc.get('error') or doc}")
    return doc


async def _cancel(tasks: set[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


class AsyncEtcd(_Calls):
    """The control plane's asyncio client: election, keep-alive, fenced writes.

    ``timeout`` is how long one endpoint is waited for before the next is
    asked.  A call given a ``budget`` (seconds for the whole call) and
    ``hedge`` keeps waiting on the endpoints already asked while it asks the
    next: an etcd member whose raft leader just died holds a keep-alive until
    a new leader is elected (1 to 2 s with etcd's defaults) and then answers
    it, so giving up on it after ``timeout`` would throw away the renewal
    that was about to succeed; a member that hangs (stopped, cut) costs
    ``timeout`` before the next is asked, never the whole budget.  Only
    idempotent calls are hedged (a keep-alive, a compare without writes).
    """

    def __init__(self, endpoints: tuple[str, ...], tls: ssl.SSLContext | None = None, timeout: float = 2.0):
        self.endpoints = list(endpoints)
        self.timeout = float(timeout)
        self._tls = tls
        self._client = httpx.AsyncClient(verify=tls if tls is not None else True, timeout=timeout)

    def clone(self) -> "AsyncEtcd":
        """A client of its own for another thread's event loop (an httpx client serves one loop)."""
        return AsyncEtcd(tuple(self.endpoints), self._tls, self.timeout)

    async def _post(self, endpoint: str, path: str, body: bytes, timeout: float) -> dict[str, Any]:
        r = await self._client.post(endpoint.rstrip("/") + path, content=body, timeout=max(0.001, timeout))
        return _check(endpoint, path, r)

    async def call(self, path: str, body: dict[str, Any], budget: float | None = None,
                   hedge: bool = False) -> dict[str, Any]:
        """The first answer from the endpoints, tried in turn; EtcdUnavailable when none answers in ``budget``.

        Without ``hedge`` one endpoint is asked at a time, each for at most
        ``timeout`` (on the event loop's clock: a member that trickles bytes
        cannot defeat it); with it, an endpoint that fails or has not answered
        in ``timeout`` brings in the next while the earlier ones keep their
        chance until the budget ends.  The default budget is ``timeout`` per
        endpoint.
        """
        loop = asyncio.get_running_loop()
        order = list(self.endpoints)
        end = loop.time() + (budget if budget is not None else self.timeout * len(order))
        content = json.dumps(body).encode()
        asked: dict[asyncio.Task[dict[str, Any]], str] = {}
        errors: dict[str, str] = {}
        pending: set[asyncio.Task[dict[str, Any]]] = set()

        def ask_next() -> None:
            endpoint = order[len(asked)]
            task = asyncio.ensure_future(self._post(endpoint, path, content, end - loop.time()))
            asked[task] = endpoint
            pending.add(task)

        try:
            while (left := end - loop.time()) > 0:
                if not pending:
                    if len(asked) == len(order):
                        break
                    ask_next()
                more = len(asked) < len(order)  # the last endpoint asked may take what is left of the budget
                done, _ = await asyncio.wait(pending, timeout=min(self.timeout, left) if more else left,
                                             return_when=asyncio.FIRST_COMPLETED)
                pending.difference_update(done)
                for task in done:
                    try:
                        doc = task.result()
                    except (httpx.HTTPError, EtcdUnavailable) as e:
                        errors[asked[task]] = str(e) or type(e).__name__
                        continue
                    self._prefer(asked[task])
                    return doc
                if more and not done:  # silent for `timeout`: ask the next, giving this one up unless hedging
                    if not hedge:
                        await _cancel(pending)
                        errors.update({asked[t]: f"no answer in {self.timeout:g}s" for t in pending})
                        pending.clear()
                    ask_next()
                elif more and hedge and pending:  # a failure while others are still waited for
                    ask_next()
        finally:
            await _cancel(pending)
        for endpoint in order:
            if endpoint not in errors:
                errors[endpoint] = "no answer in time" if endpoint in asked.values() else "not asked: out of time"
        raise EtcdUnavailable("; ".join(f"{e}: {errors[e]}" for e in order))

    def _prefer(self, endpoint: str) -> None:
        """Stick to the endpoint that answered: the next call asks it first."""
        if endpoint in self.endpoints and self.endpoints[0] != endpoint:
            self.endpoints.remove(endpoint)
            self.endpoints.insert(0, endpoint)

    async def grant(self, ttl: int) -> int:
        return int((await self.call("/v3/lease/grant", {"TTL": ttl}))["ID"])

    async def keepalive(self, lease: int, budget: float | None = None) -> int:
        """The lease's TTL after renewing it; 0 when it has expired (or was revoked).  Hedged: idempotent."""
        doc = await self.call("/v3/lease/keepalive", {"ID": str(lease)}, budget, hedge=budget is not None)
        return int((doc.get("result") or {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        await self.call("/v3/lease/revoke", {"ID": str(lease)})

    async def get(self, key: str) -> KeyValue | None:
        return self.first_kv(await self.call("/v3/kv/range", {"key": b64(key)}))

    async def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
                  failure: list[dict[str, Any]] | None = None,
                  budget: float | None = None) -> tuple[bool, dict[str, Any]]:
        """A txn; hedged within ``budget`` only when it writes nothing (a compare, reads)."""
        ops = success + (failure or [])
        hedge = budget is not None and all("request_range" in op for op in ops)
        doc = await self.call("/v3/kv/txn", self.txn_body(compare, success, failure), budget, hedge)
        return bool(doc.get("succeeded")), doc

    async def aclose(self) -> None:
        await self._client.aclose()


class BlockingEtcd(_Calls):
    """The store's blocking client: a read at start, a write per operator action (milliseconds)."""

    def __init__(self, endpoints: tuple[str, ...], tls: ssl.SSLContext | None = None, timeout: float = 2.0):
        self.endpoints = list(endpoints)
        self._client = httpx.Client(verify=tls if tls is not None else True, timeout=timeout)

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        errors = []
        for i, endpoint in enumerate(list(self.endpoints)):
            try:
                doc = _check(endpoint, path, self._client.post(endpoint.rstrip("/") + path, content=json.dumps(body)))
            except (httpx.HTTPError, EtcdUnavailable) as e:
                errors.append(f"{endpoint}: {str(e) or type(e).__name__}")
                continue
            if i:
                self.endpoints.insert(0, self.endpoints.pop(i))
            return doc
        raise EtcdUnavailable("; ".join(errors))

    def get(self, key: str) -> KeyValue | None:
        return self.first_kv(self.call("/v3/kv/range", {"key": b64(key)}))

    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
            failure: list[dict[str, Any]] | None = None) -> tuple[bool, dict[str, Any]]:
        doc = self.call("/v3/kv/txn", self.txn_body(compare, success, failure))
        return bool(doc.get("succeeded")), doc

    def close(self) -> None:
        self._client.close()
