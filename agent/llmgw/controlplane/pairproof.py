"""A prefill replica joins the routers only after a real prefill -> decode round trip.

Each engine's own readiness (a completion answered) says nothing about the
transfer between them: a side channel a firewall blocks, UCX on the wrong
adapter or a decoder of another vLLM release all leave both engines healthy
while every pull fails, and a decoder under vLLM's default policy then
recomputes each prompt in silence: the pair serves at half its capacity
and no error says so.  So the control plane proves each Ready prefill
replica once, against a Ready decode replica of the same model, the way the
router will use them: a one-token prefill with ``do_remote_decode``, then a
one-token decode with the answer's ``kv_transfer_params``, and the decoder
must count the pull (``vllm:nixl_xfer_time_seconds_count`` up,
``vllm:nixl_num_failed_transfers_total`` not).  Until then the replica is left
out of the endpoint set; the decode replicas serve at once, prefilling
locally.  A failed proof is retried every ``retry_after`` seconds, and the
reason is kept for ``/v1/replicas`` readers and the log.

A proof holds for one engine process, not for a replica id: a failed engine
is replaced under a new replica id today, but an engine that ever came back
under the same one would be a new NIXL agent with a new engine id (and perhaps
another environment), so it is held and proved again.

SGLang's pairs are proved the way its router uses them: one one-token
request to both engines at once, naming the prefill's bootstrap server and a
fresh room (``llmgw.kvbootstrap``); both must answer, the prefill engine must
count the transfer (``sglang:kv_transfer_latency_ms_count`` up) and the decoder
no failed one (``sglang:num_transfer_failed_reqs_total``,
``sglang:num_bootstrap_failed_reqs_total`` unchanged).  An SGLang decoder
cannot prefill locally, so until a prefill replica is proved its model has no
usable pair and the routers answer 503.

``PairProofs`` is the book (pure, explicit times); ``prove`` is the one
round trip (I/O).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp

from llmgw import promtext
from llmgw.controlplane.replicas import Replica, ReplicaBook, ReplicaState
from llmgw.kvbootstrap import bootstrap_fields, new_room
from llmgw.kvtransfer import PREFILL_REQUEST, check_prefill_params

log = logging.getLogger("llmgw.controlplane")

PROMPT = "llmgw pair check: " + "x " * 64  # a few KV blocks, so something is transferred
XFER_COUNT = "vllm:nixl_xfer_time_seconds_count"
FAILED = "vllm:nixl_num_failed_transfers_total"  # the counter as exposed
SGLANG_XFER = "sglang:kv_transfer_latency_ms_count"  # observed by the prefill engine per transfer sent
SGLANG_FAILED = ("sglang:num_transfer_failed_reqs_total", "sglang:num_bootstrap_failed_reqs_total")  # decoder's


def role_of(r: Replica) -> str | None:
    r0 = r.shards.get(0)
    kv = r0.spec.get("profile", {}).get("kv_transfer") if r0 is not None else None
    return kv.get("role") if isinstance(kv, dict) else None


def _ready(r: Replica) -> bool:
    return not r.retired and r.state is ReplicaState.READY


def incarnation(r: Replica) -> tuple[Any, ...]:
    """Which engine process serves the replica now: rank 0's process identity as its agent reports it,
    else when rank 0 entered its state (a restart passes through another state)."""
    r0 = r.shards.get(0)
    if r0 is None:
        return ()
    p = r0.process
    if isinstance(p, dict) and "pid" in p:
        return ("process", p.get("pid"), p.get("start_time"), p.get("boot_id"))
    return ("since", r0.state_since)


@dataclass(frozen=True)
class Endpoint:
    replica_id: str
    url: str
    api_key: str | None
    bootstrap_port: int | None = None  # an SGLang prefill replica's bootstrap server (``kvbootstrap``)


@dataclass(frozen=True)
class Trial:
    """One proof to run: this prefill replica against that decode replica, for ``model`` (served name)."""

    model: str
    prefill: Endpoint
    decode: Endpoint
    incarnation: tuple[Any, ...] = ()  # the prefill engine process the proof is for (``incarnation``)


class PairProofs:
    """Which Ready prefill replicas have proved a transfer, which wait, and which to try now."""

    def __init__(self, retry_after: float = 5.0):
        self.retry_after = retry_after
        self.proved: dict[str, tuple[Any, ...]] = {}  # replica id -> the engine process a round trip proved
        self.failed: dict[str, tuple[float, str]] = {}  # replica id -> (when, why)
        self.running: set[str] = set()

    def held(self, book: ReplicaBook) -> frozenset[str]:
        """Ready prefill replicas whose current engine process no round trip has proved: left out of the
        endpoint set."""
        return frozenset(r.replica_id for r in book.replicas.values()
                         if _ready(r) and role_of(r) == "prefill" and self.proved.get(r.replica_id) != incarnation(r))

    def due(self, book: ReplicaBook, urls: dict[str, str], now: float,
            bootstraps: dict[str, int] | None = None) -> list[Trial]:
        """The proofs to start now: each held prefill replica not running or backing off, with the
        first Ready decode replica (by id) of its model; none while the model has no Ready decoder."""
        live = set(book.replicas)
        self.proved = {k: v for k, v in self.proved.items() if k in live}
        self.failed = {k: v for k, v in self.failed.items() if k in live}
        decoders: dict[str, Replica] = {}
        for r in sorted(book.replicas.values(), key=lambda r: r.replica_id):
            if _ready(r) and role_of(r) == "decode" and r.replica_id in urls:
                decoders.setdefault(_served(r), r)
        out = []
        for rid in sorted(self.held(book)):
            if rid in self.running or rid not in urls:
                continue
            failed = self.failed.get(rid)
            if failed is not None and now < failed[0] + self.retry_after:
                continue
            p = book.replicas[rid]
            d = decoders.get(_served(p))
            if d is None:
                continue
            out.append(Trial(_served(p), Endpoint(rid, urls[rid], _key(p), (bootstraps or {}).get(rid)),
                             Endpoint(d.replica_id, urls[d.replica_id], _key(d)), incarnation(p)))
        return out

    def record(self, trial: Trial, problem: str | None, now: float) -> None:
        rid = trial.prefill.replica_id
        self.running.discard(rid)
        if problem is None:
            self.proved[rid] = trial.incarnation
            self.failed.pop(rid, None)
            log.info("%s: transfer to %s proved (one-token prefill -> decode); routed as prefill",
                     rid, trial.decode.replica_id)
        else:
            self.failed[rid] = (now, problem)
            log.warning("%s: not routed as prefill: the round trip to %s failed: %s",
                        rid, trial.decode.replica_id, problem)


def _served(r: Replica) -> str:
    r0 = r.shards.get(0)
    return (r0.spec.get("model", {}).get("served_name") if r0 is not None else None) or r.model


def _key(r: Replica) -> str | None:
    r0 = r.shards.get(0)
    return r0.spec.get("api_key") if r0 is not None else None


async def prove(session: aiohttp.ClientSession, trial: Trial, timeout: float,
                ssl_context: ssl.SSLContext | None = None) -> str | None:
    """One round trip; None when the decoder pulled the prefilled blocks, else why not."""
    t = aiohttp.ClientTimeout(total=timeout)

    def headers(ep: Endpoint) -> dict[str, str]:
        return {"Authorization": f"Bearer {ep.api_key}"} if ep.api_key else {}

    async def metrics() -> tuple[float, float]:
        text = await _metrics_page(session, trial.decode.url, t, ssl_context)
        return promtext.total(text, XFER_COUNT), promtext.total(text, FAILED)

    async def complete(ep: Endpoint, extra: dict[str, Any]) -> tuple[int, Any]:
        body = {"model": trial.model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": False, **extra}
        async with session.post(f"{ep.url}/v1/completions", json=body, headers=headers(ep), timeout=t,
                                ssl=ssl_context) as r:
            try:
                return r.status, await r.json(content_type=None)
            except ValueError:
                return r.status, None

    if trial.prefill.bootstrap_port is not None:
        return await _prove_pair(session, trial, t, ssl_context, complete)
    try:
        before = await metrics()
        status, doc = await complete(trial.prefill, {"kv_transfer_params": dict(PREFILL_REQUEST)})
        if status != 200 or not isinstance(doc, dict):
            return f"the prefill engine answered HTTP {status}"
        problems = check_prefill_params(doc.get("kv_transfer_params"))
        if problems:
            return "the prefill answer cannot go to a decoder: " + "; ".join(problems)
        status, _ = await complete(trial.decode, {"kv_transfer_params": doc["kv_transfer_params"]})
        after = await metrics()
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    if after[1] > before[1]:  # vLLM 0.32's default policy fails the request, "recompute" prefills it locally
        return (f"the decoder counted a failed transfer ({FAILED}); "
                + (f"it answered HTTP {status}" if status != 200 else "it prefilled locally"))
    if status != 200:
        return f"the decode engine answered HTTP {status}"
    if after[0] <= before[0]:
        return f"the decoder counted no transfer ({XFER_COUNT} unchanged)"
    return None


async def _metrics_page(session: aiohttp.ClientSession, url: str, t: aiohttp.ClientTimeout,
                        ssl_context: ssl.SSLContext | None) -> str:
    """An engine's ``/metrics`` page, read as both kinds of proof read it."""
    async with session.get(f"{url}/metrics", timeout=t, ssl=ssl_context) as r:
        return await r.text()


async def _prove_pair(session: aiohttp.ClientSession, trial: Trial, t: aiohttp.ClientTimeout,
                      ssl_context: ssl.SSLContext | None, complete: Callable[..., Any]) -> str | None:
    """SGLang's round trip: both engines at once, one room; None when the transfer was made and counted."""
    async def read(url: str, names: tuple[str, ...]) -> float:
        text = await _metrics_page(session, url, t, ssl_context)
        return sum(promtext.total(text, n) for n in names)

    assert trial.prefill.bootstrap_port is not None
    fields = bootstrap_fields(trial.prefill.url, trial.prefill.bootstrap_port, new_room())
    try:
        sent, failed = await read(trial.prefill.url, (SGLANG_XFER,)), await read(trial.decode.url, SGLANG_FAILED)
        (pstatus, _), (dstatus, _) = await asyncio.gather(complete(trial.prefill, fields),
                                                          complete(trial.decode, fields))
        sent_after, failed_after = (await read(trial.prefill.url, (SGLANG_XFER,)),
                                    await read(trial.decode.url, SGLANG_FAILED))
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    if failed_after > failed:
        return (f"the decoder counted a failed transfer ({' or '.join(SGLANG_FAILED)}); "
                f"it answered HTTP {dstatus}")
    if pstatus != 200:
        return f"the prefill engine answered HTTP {pstatus}"
    if dstatus != 200:
        return f"the decode engine answered HTTP {dstatus}"
    if sent_after <= sent:
        return f"the prefill engine counted no transfer ({SGLANG_XFER} unchanged)"
    return None


def bootstraps_of(eps: Iterable[dict[str, Any]]) -> dict[str, int]:
    """replica id -> an SGLang prefill replica's bootstrap port, from the endpoint set."""
    return {e["replica_id"]: e["bootstrap_port"] for e in eps if e.get("bootstrap_port") is not None}


def urls_of(eps: Iterable[dict[str, Any]]) -> dict[str, str]:
    """replica id -> rank-0 URL, from the endpoint set (``reconcile.endpoints``)."""
    return {e["replica_id"]: e["url"] for e in eps if not e.get("draining")}


class PairProver:
    """``PairProofs`` run by the control plane: filters each endpoint set it publishes and starts
    the proofs due, each in a task of its own; a finished proof calls ``changed`` (a new pass)."""

    def __init__(self, changed: Callable[[], None], ca: str | None = None, timeout: float = 30.0,
                 retry_after: float = 5.0):
        self.proofs = PairProofs(retry_after)
        self._changed = changed
        self._ca = ca
        self.timeout = timeout
        self._tasks: set[asyncio.Task[None]] = set()

    def publishable(self, book: ReplicaBook, eps: list[dict[str, Any]], now: float,
                    clock: Callable[[], float]) -> list[dict[str, Any]]:
        """``eps`` less the prefill replicas not proved yet; the proofs due are started."""
        if not any(e.get("role") == "prefill" for e in eps) and not self.proofs.proved:
            return eps  # no disaggregated model Ready: nothing to hold or prove
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            running = False
        else:
            running = True
        if running:
            for trial in self.proofs.due(book, urls_of(eps), now, bootstraps_of(eps)):
                self.proofs.running.add(trial.prefill.replica_id)
                task = asyncio.get_running_loop().create_task(self._run(trial, clock),
                                                              name=f"pair proof {trial.prefill.replica_id}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        held = self.proofs.held(book)
        return [e for e in eps if e["replica_id"] not in held]

    async def _run(self, trial: Trial, clock: Callable[[], float]) -> None:
        ctx = ssl.create_default_context(cafile=self._ca) if self._ca else None
        try:
            async with aiohttp.ClientSession() as session:
                problem = await prove(session, trial, self.timeout, ctx)
        except Exception as e:  # one proof's bug must not stop the others, nor the control plane
            log.exception("pair proof of %s failed", trial.prefill.replica_id)
            problem = f"{type(e).__name__}: {e}"
        self.proofs.record(trial, problem, clock())
        self._changed()
        if problem is not None:  # a settled fleet may run no pass of its own by then
            asyncio.get_running_loop().call_later(self.proofs.retry_after, self._changed)

    def cancel(self) -> None:
        for t in list(self._tasks):
            t.cancel()
