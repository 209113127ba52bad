"""Live per-endpoint state: in-flight count, health, connection pool.

The endpoint table says what exists; this module keeps what the data path
learns about each endpoint and carries it across table revisions (an
endpoint that merely started draining keeps its health record and its
pool).  Each endpoint has its own connection pool (``upstream.Pool``) so that
a backend that accepts connections and never answers ties up only its own.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .balancing import LeastOutstanding, PrefixAffinity, best_holder
from .endpoints import Endpoint, EndpointTable
from .errors import RATE_LIMIT, SERVER, RouterError
from .metrics import EndpointMetrics, RouterMetrics
from .outlier import Health, OutlierPolicy
from .settings import RouterSettings
from .upstream import Pool

log = logging.getLogger("llmgw.router")


def engine_ssl_context(settings: RouterSettings) -> ssl.SSLContext | None:
    """How https:// engines are verified: the fleet CA (engine_ca, else control_plane.ca), hostname
    against the certificate's SANs; None: the system's CAs (an engine of the operator's own)."""
    ca = settings.engine_ca_file
    if ca is None:
        return None
    from llmgw.tls.context import client_context

    return client_context(ca)


class EndpointRuntime:
    __slots__ = ("id", "key", "endpoint", "outstanding", "limit", "health", "pool", "retired", "m",
                 "_settings", "_ssl")

    def __init__(self, ep: Endpoint, settings: RouterSettings, metrics: RouterMetrics,
                 engine_ssl: ssl.SSLContext | None = None) -> None:
        self.id = ep.id
        self.key = (ep.id, ep.url, ep.model, ep.api_key)
        self.endpoint = ep
        self.outstanding = 0
        self.limit = ep.max_concurrency or settings.limits.max_concurrency_per_endpoint
        self.health = Health()
        self.pool: Pool | None = None
        self.retired = False
        self.m = EndpointMetrics(metrics, ep.model, ep.id)
        self._settings = settings
        self._ssl = engine_ssl

    def update(self, ep: Endpoint) -> None:
        self.endpoint = ep
        self.limit = ep.max_concurrency or self._settings.limits.max_concurrency_per_endpoint

    def get_pool(self) -> Pool:
        pool = self.pool
        if pool is None or pool.closed:
            s = self._settings
            pool = self.pool = Pool(self.endpoint.url, s.timeouts.connect, s.limits.upstream_keepalive,
                                    self.endpoint.api_key, self._ssl)
        return pool

    async def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


@dataclass(frozen=True)
class ModelGroup:
    model: str
    members: tuple[EndpointRuntime, ...]  # what takes the model's requests (roles both and decode)
    # A disaggregated model's prefill endpoints, a group of their own (ejected on their own
    # failures); None: the model is served whole by each member.
    prefill: "ModelGroup | None" = None
    # Every member not draining is asleep (scale to sleep), or none is left of a model that scales from
    # zero: only a wake (or a start) helps (router/holdqueue.py).
    # Worked out once per table revision, so a request to a model that is awake pays nothing for it.
    asleep: bool = False
    # Served by SGLang's prefill/decode protocol: each try goes to a prefill and a decode endpoint at once
    # (router/dualdispatch.py), never to a decoder alone. Worked out once per table revision.
    dual: bool = False

    def ejected_count(self, now: float) -> int:
        return sum(1 for m in self.members if m.health.is_ejected(now))


class Routing:
    """Endpoint runtimes for the table's current revision, and the pick."""

    def __init__(self, table: EndpointTable, settings: RouterSettings, metrics: RouterMetrics,
                 scorer: LeastOutstanding | PrefixAffinity) -> None:
        self.table = table
        self.settings = settings
        self.metrics = metrics
        self.scorer = scorer
        # a scorer that tokenizes off the loop before its pick (CacheAware with a model's tokenizer);
        # None for the rest, whose requests skip ``prepare`` altogether
        self.prepares = getattr(scorer, "prepare", None)
        # requests held per model while one of its replicas wakes (router/holdqueue.py): in flight to
        # the model as far as the autoscaler is concerned (router/loadreport.py)
        self.held: dict[str, int] = {}
        self.policy = OutlierPolicy(settings.outlier)
        self.engine_ssl = engine_ssl_context(settings)  # loaded once: a bad CA file fails the start
        self._rev = -1
        self._groups: dict[str, ModelGroup] = {}
        self._from_zero: frozenset[str] = frozenset()
        # keyed by (id, url, model, engine key): a changed key is a new pool, never a mixed one
        self._runtimes: dict[tuple[str, str, str, str | None], EndpointRuntime] = {}
        self._retired: list[EndpointRuntime] = []
        self.sync()

    def sync(self) -> None:
        """Follow the table; cheap when the revision did not move."""
        if self.table.revision == self._rev:
            return
        rev, eps, from_zero = self.table.snapshot_from_zero()
        runtimes: dict[tuple[str, str, str, str | None], EndpointRuntime] = {}
        groups: dict[str, list[EndpointRuntime]] = {}
        prefills: dict[str, list[EndpointRuntime]] = {}
        for ep in eps:
            key = (ep.id, ep.url, ep.model, ep.api_key)
            rt = self._runtimes.get(key)
            if rt is None:
                rt = EndpointRuntime(ep, self.settings, self.metrics, self.engine_ssl)
            else:
                rt.update(ep)
            runtimes[key] = rt
            (prefills if ep.role == "prefill" else groups).setdefault(ep.model, []).append(rt)
        for key, rt in self._runtimes.items():
            if key not in runtimes:
                rt.retired = True
                self._retired.append(rt)
        self._runtimes = runtimes
        self._groups = {m: ModelGroup(m, tuple(groups.get(m, ())),
                                      ModelGroup(m, tuple(prefills[m])) if m in prefills else None,
                                      _asleep(groups.get(m, ()), m in from_zero),
                                      _dual(groups.get(m, ()), prefills.get(m, ())))
                        for m in {**groups, **prefills, **dict.fromkeys(from_zero)}}
        self._from_zero = from_zero
        self._rev = rev

    @property
    def revision(self) -> int:
        return self._rev

    def group(self, model: str) -> ModelGroup | None:
        return self._groups.get(model)

    def models(self) -> list[str]:
        """Models with at least one endpoint not draining, and those that scale from zero (a request
        for one starts a replica)."""
        return sorted(m for m, g in self._groups.items()
                      if m in self._from_zero or any(not r.endpoint.draining for r in g.members))

    def runtimes(self) -> list[EndpointRuntime]:
        return list(self._runtimes.values())

    async def prepare(self, group: ModelGroup, payload: dict[str, Any] | None) -> dict[str, Any] | None:
        """``payload`` as the scorer wants it for ``pick``: with token ids tokenized off the event
        loop for a model routed by its own tokenizer (``CacheAware.prepare``), else as is."""
        prepare = self.prepares
        return payload if prepare is None else await prepare(group.members, payload)

    def pick(self, group: ModelGroup, tried: set[str], payload: dict[str, Any] | None) -> EndpointRuntime | RouterError | None:
        """An endpoint for the next attempt; a RouterError saying why there is none on a
        first attempt; None when a retry has nothing left to try."""
        # A retry may come long after the request synced: an endpoint that started
        # draining (or left the table) in between must not get it.
        self.sync()
        now = time.monotonic()
        choice = self.scorer.pick(group.members, _eligible(tried, now), payload)
        if choice is not None:
            return choice
        if tried:
            return None
        return self._why_none(group, now)

    def predicted(self, group: ModelGroup) -> int | None:
        """The prompt tokens the last ``pick`` of ``group`` expects its endpoint to hold cached
        (``CacheAware.predicted``); None when the route-key index did not place it. Read right
        after ``pick``: the scorer keeps only its last pick's."""
        predicted = getattr(self.scorer, "predicted", None)
        return predicted(group.members) if callable(predicted) else None

    def pick_prefill(self, pgroup: ModelGroup, tried: set[str],
                     by_cache: tuple[Callable[[EndpointRuntime], int | None], float] | None = None
                     ) -> EndpointRuntime | None:
        """The prefill endpoint to compute a prompt, else None (none can take one more).

        ``by_cache`` (the route-key index's view, for prefill engines that publish KV events, and its
        load bound) says how many of the prompt's leading tokens an endpoint's engine holds: the one
        holding the most computes the least, so it is chosen unless it carries more than the load
        bound times the group's mean load (as the cache-aware scorer bounds a hot prefix). Without a
        holder, or without the view, the endpoint with the fewest requests in flight."""
        eligible = _eligible(tried, time.monotonic())
        cands = [m for m in pgroup.members if eligible(m)]
        return choose_prefill(cands, by_cache)

    def _why_none(self, group: ModelGroup, now: float) -> RouterError:
        draining = sum(1 for m in group.members if m.endpoint.draining)
        ejected = sum(1 for m in group.members if not m.endpoint.draining and m.health.is_ejected(now))
        asleep = sum(1 for m in group.members if not m.endpoint.draining and m.endpoint.sleeping)
        full = [m for m in group.members if not m.endpoint.draining and not m.health.is_ejected(now)
                and not m.endpoint.sleeping]
        if full:
            return RouterError(
                429, f"all {len(full)} endpoint(s) of model {group.model!r} are at their concurrency limit; "
                     "retry later", RATE_LIMIT, "endpoints_saturated", klass="saturated", retry_after=1)
        return RouterError(
            503, f"no endpoint of model {group.model!r} can take requests now "
                 f"({ejected} ejected after failures, {draining} draining"
                 + (f", {asleep} asleep" if asleep else "") + ")",
            SERVER, "no_healthy_endpoint", klass="unavailable", retry_after=1)

    def record(self, rt: EndpointRuntime, group: ModelGroup, outcome: str, failure: bool) -> None:
        """An attempt ended; feed outlier detection (failures only count against the engine)."""
        now = time.monotonic()
        rt.m.attempt(outcome)
        if failure:
            rt.health.last_failure = outcome
            if self.policy.on_failure(rt.health, now, group.ejected_count(now), len(group.members)):
                self.metrics.ejections.labels(group.model, rt.id).inc()
                self.metrics.ejected.labels(group.model, rt.id).set(1)
                log.warning("ejected endpoint %s (model %s, %s) for %.0fs after %s; ejection #%d",
                            rt.id, group.model, rt.endpoint.url, rt.health.ejected_until - now, outcome,
                            rt.health.ejections)
        elif outcome in ("ok", "client_error"):
            self.policy.on_success(rt.health, now)

    def usable(self, rt: EndpointRuntime, tried: set[str]) -> bool:
        """Whether an endpoint picked earlier may still take the request's next try (the decoder a
        remote-prefill decision was made for, after the prefill: it may have started draining)."""
        self.sync()
        return _eligible(tried, time.monotonic())(rt)

    def housekeeping(self) -> list[EndpointRuntime]:
        """Refresh sampled gauges; return retired runtimes whose last request finished."""
        self.sync()
        now = time.monotonic()
        for rt in self._runtimes.values():
            if rt.pool is not None:
                rt.pool.sweep()
            self.metrics.outstanding.labels(rt.endpoint.model, rt.id).set(rt.outstanding)
            self.metrics.ejected.labels(rt.endpoint.model, rt.id).set(1 if rt.health.is_ejected(now) else 0)
        done = [rt for rt in self._retired if rt.outstanding == 0]
        if done:
            self._retired = [rt for rt in self._retired if rt.outstanding > 0]
            for rt in done:
                self.metrics.outstanding.labels(rt.endpoint.model, rt.id).set(0)
                self.metrics.ejected.labels(rt.endpoint.model, rt.id).set(0)
        return done

    async def close(self) -> None:
        for rt in list(self._runtimes.values()) + self._retired:
            await rt.close()


def choose_prefill(cands: list[Any], by_cache: tuple[Callable[[Any], int | None], float] | None) -> Any:
    """Among ``cands`` (each with ``outstanding``): the one whose engine holds the most of the prompt
    within the load bound, ties to the least loaded; else the least loaded. Pure, for tests."""
    if not cands:
        return None
    least = min(cands, key=lambda m: m.outstanding)
    if by_cache is None:
        return least
    best, _ = best_holder(cands, *by_cache)
    return best if best is not None else least


def _dual(members: list[EndpointRuntime] | tuple[EndpointRuntime, ...],
          prefills: list[EndpointRuntime] | tuple[EndpointRuntime, ...]) -> bool:
    """Whether the model's pairs speak SGLang's protocol: its decoders need a prefill, or its prefill
    endpoints name a bootstrap server."""
    return (any(m.endpoint.requires_prefill for m in members)
            or any(p.endpoint.bootstrap_port is not None for p in prefills))


def _asleep(members: list[EndpointRuntime] | tuple[EndpointRuntime, ...], from_zero: bool = False) -> bool:
    """No member awake and taking requests, and a wake (or a start) would bring one: some asleep, or
    none at all (draining ones aside) of a model that scales from zero."""
    awake_or_asleep = [m for m in members if not m.endpoint.draining]
    return (bool(awake_or_asleep) or from_zero) and all(m.endpoint.sleeping for m in awake_or_asleep)


def _eligible(tried: set[str], now: float) -> Callable[[EndpointRuntime], bool]:
    """Whether an endpoint may take a request's next try: room under its limit, not draining, not
    tried by this request, still in the table, not ejected. One rule for decode and prefill picks."""
    def eligible(m: EndpointRuntime) -> bool:
        return (m.outstanding < m.limit and not m.endpoint.draining and m.id not in tried
                and not m.retired and now >= m.health.ejected_until
                and not m.endpoint.sleeping)  # asleep: router/holdqueue.py waits for its wake
    return eligible


async def run_housekeeping(routing: Routing, interval: float = 1.0) -> None:
    while True:
        for rt in routing.housekeeping():
            await rt.close()
        await asyncio.sleep(interval)
