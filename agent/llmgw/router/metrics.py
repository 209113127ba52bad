"""Prometheus metrics of the data path.

Each app gets its own registry (several routers may share a process in
tests and in ``llmgw server``).  With ``--workers N`` every worker writes to
prometheus-client's multiprocess directory and any worker's ``/metrics``
answers for all of them, so a scrape that lands on one worker through
SO_REUSEPORT still sees the whole router.

Labels are bounded: ``model`` only takes names present in the endpoint
table (an unknown model a client invents is counted as ``-``), ``endpoint``
is an endpoint id (control-plane endpoints use replica names; static ones
default to MODEL@URL).  Nothing secret is exported: no keys, key hashes,
key names or request contents, except the usage counters of keys with a
``limits`` block (``llmgw_router_key_*``), labelled with the key's configured
name (never the key or its hash): a bounded set the operator chose to meter.
"""

from __future__ import annotations

import os
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import multiprocess

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "llmgw_router_requests", "Client requests answered, by model and HTTP status.",
            ["model", "status"], registry=r)
        self.errors = Counter(
            "llmgw_router_errors", "Client-visible errors by class (bad_request, unauthorized, "
            "model_not_found, too_large, saturated, unavailable, upstream_error, upstream_timeout, "
            "stream_broken, stream_error, internal, unknown_url, method_not_allowed; refused by a client cap: "
            "max_requests_per_key, max_requests_per_source, max_body_bytes_per_key, max_body_bytes_per_source; "
            "body_timeout).",
            ["model", "class"], registry=r)
        self.attempts = Counter(
            "llmgw_router_upstream_attempts", "Requests sent to engines, by outcome (ok, client_error, "
            "status_5xx, engine_auth, rate_limited, connect, timeout, first_token_timeout, inter_token_timeout, "
            "inband_error, broken, cancelled, error; bad_prefill: a prefill answer a decoder could not use).",
            ["model", "endpoint", "outcome"], registry=r)
        self.retries = Counter(
            "llmgw_router_retries", "Retries made, by the failure that caused them.",
            ["model", "reason"], registry=r)
        self.retries_denied = Counter(
            "llmgw_router_retries_denied", "Retries not made because the retry budget was spent.",
            ["model"], registry=r)
        self.ejections = Counter(
            "llmgw_router_ejections", "Times an endpoint was ejected by outlier detection.",
            ["model", "endpoint"], registry=r)
        self.ejected = Gauge(
            "llmgw_router_endpoint_ejected", "1 while an endpoint is ejected (max over workers).",
            ["model", "endpoint"], registry=r, multiprocess_mode="livemax")
        self.outstanding = Gauge(
            "llmgw_router_endpoint_outstanding", "Requests in flight to an endpoint (sampled every second).",
            ["model", "endpoint"], registry=r, multiprocess_mode="livesum")
        self.active_streams = Gauge(
            "llmgw_router_active_streams", "Streams being relayed to clients.",
            ["model", "endpoint"], registry=r, multiprocess_mode="livesum")
        self.ttft = Histogram(
            "llmgw_router_ttft_seconds", "Time from request arrival to the first token sent (streams).",
            ["model", "endpoint"], buckets=TTFT_BUCKETS, registry=r)
        self.inter_token = Histogram(
            "llmgw_router_inter_token_seconds", "Gap between consecutive chunks relayed on a stream.",
            ["model", "endpoint"], buckets=ITL_BUCKETS, registry=r)
        self.prefill = Counter(
            "llmgw_router_prefill", "Remote prefills of disaggregated models, by outcome (ok; fallback: every "
            "prefill endpoint tried failed and the decoder prefilled; unavailable: no prefill endpoint could take it; "
            "SGLang's pairs, one per try: failed: the prefill request failed; client_error: it refused the request; "
            "cancelled: its decode try ended first).",
            ["model", "outcome"], registry=r)
        self.prefill_seconds = Histogram(
            "llmgw_router_prefill_seconds", "Time spent in the prefill phase, failed tries included.",
            ["model"], buckets=TTFT_BUCKETS, registry=r)
        # whether a disaggregated model's request was prefilled remotely, and why (router/prefill.py)
        self.prefill_decisions = Counter(
            "llmgw_router_prefill_decisions", "Remote-prefill decisions for requests of disaggregated models "
            "(remote; short: the prompt is under min_prompt_bytes or min_uncached_tokens; cached: the chosen "
            "decoder caches enough of it that the rest is under min_uncached_tokens; no_prefill_endpoint: remote "
            "was wanted and no prefill endpoint could take it).", ["model", "decision"], registry=r)
        self.prefill_picks = Counter(
            "llmgw_router_prefill_picks", "Prefill endpoints chosen for remote prefills, by what chose them (cache: "
            "the route-key index says its engine holds a leading part of the prompt; load: the fewest requests in "
            "flight).", ["model", "by"], registry=r)
        self.duration = Histogram(
            "llmgw_router_request_duration_seconds", "Whole request duration as seen by the router.",
            ["model"], buckets=DURATION_BUCKETS, registry=r)
        # per-key usage and refusals, only for keys with a limits block (router/limitsgate.py)
        self.key_requests = Counter(
            "llmgw_router_key_requests", "Requests admitted for a limited key, by key name and model.",
            ["key", "model"], registry=r)
        self.key_prompt_tokens = Counter(
            "llmgw_router_key_prompt_tokens", "Prompt tokens settled for a limited key (engine usage, else the "
            "router's estimate), by key name and model.", ["key", "model"], registry=r)
        self.key_completion_tokens = Counter(
            "llmgw_router_key_completion_tokens", "Completion tokens settled for a limited key (engine usage, else "
            "one per event relayed), by key name and model.", ["key", "model"], registry=r)
        self.key_cached_prompt_tokens = Counter(
            "llmgw_router_key_cached_prompt_tokens", "Of a limited key's prompt tokens, those the engine reported "
            "found in its prefix cache (usage.prompt_tokens_details.cached_tokens), by key name and model.",
            ["key", "model"], registry=r)
        self.key_refusals = Counter(
            "llmgw_router_key_refusals", "Requests of a limited key refused (429) by one of its limits "
            "(requests, input_tokens, output_tokens, tokens, tokens_per_day, concurrent_requests).",
            ["key", "model", "limit"], registry=r)
        # cache-aware routing: what the index predicted cached against what the engine reported
        # (router/cachehits.py), for requests the index placed
        self.cache_predicted_tokens = Counter(
            "llmgw_router_cache_predicted_tokens", "Prompt tokens the route-key index predicted the chosen replica "
            "held in its prefix cache, for requests it placed whose answer reported cached tokens.",
            ["model"], registry=r)
        self.cache_reported_tokens = Counter(
            "llmgw_router_cache_reported_tokens", "Prompt tokens the engine reported reused from its prefix cache "
            "(usage.prompt_tokens_details.cached_tokens) for the same requests.", ["model"], registry=r)
        self.cache_predictions = Counter(
            "llmgw_router_cache_predictions", "Requests the route-key index placed, by what the answer said "
            "(reported: it carried cached_tokens; unreported: it did not, e.g. vLLM without "
            "--enable-prompt-tokens-details, a failed or abandoned request).", ["model", "outcome"], registry=r)

        self._done: dict[tuple[str, int], tuple] = {}
        self._errors: dict[tuple[str, str], Counter] = {}

    def request_done(self, model: str, status: int, seconds: float) -> None:
        """Count a finished client request (children cached: ``labels()`` takes a lock)."""
        c = self._done.get((model, status))
        if c is None:
            c = self._done[(model, status)] = (self.requests.labels(model, str(status)), self.duration.labels(model))
        c[0].inc()
        c[1].observe(seconds)

    def error(self, model: str, klass: str) -> None:
        c = self._errors.get((model, klass))
        if c is None:
            c = self._errors[(model, klass)] = self.errors.labels(model, klass)
        c.inc()

    def refused(self, status: int, klass: str, seconds: float) -> None:
        """A request refused before its body was read (a client cap, the body deadline, a chunked body too large).

        Counted as the proxy counts its own answers, under model ``-`` (the body
        that names the model was not read), so a dashboard of outcomes sees it.
        """
        self.request_done("-", status, seconds)
        self.error("-", klass)

    def render(self) -> bytes:
        path = multiprocess_dir()
        if path:
            reg = CollectorRegistry()
            multiprocess.MultiProcessCollector(reg, path=path)
            return generate_latest(reg)
        return generate_latest(self.registry)


class EndpointMetrics:
    """Label children of one endpoint, resolved once (label lookup takes a lock)."""

    __slots__ = ("_m", "model", "endpoint", "ttft", "inter_token", "active_streams", "_attempts")

    def __init__(self, m: RouterMetrics, model: str, endpoint: str) -> None:
        self._m = m
        self.model = model
        self.endpoint = endpoint
        self.ttft = m.ttft.labels(model, endpoint)
        self.inter_token = m.inter_token.labels(model, endpoint)
        self.active_streams = m.active_streams.labels(model, endpoint)
        self._attempts: dict[str, Counter] = {}

    def attempt(self, outcome: str) -> None:
        c = self._attempts.get(outcome)
        if c is None:
            c = self._attempts[outcome] = self._m.attempts.labels(self.model, self.endpoint, outcome)
        c.inc()


class BatchedHistogram:
    """One stream's observations of a Histogram child, added to it at most once a second.

    ``Histogram.observe`` takes a lock for the sum and another for the bucket
    and walks the bucket list; once per relayed chunk that was a visible share
    of the router's CPU per chunk.  Here an observation is a bisect and two
    additions to local counts; the child gets them in one batch at least once
    a second and when the stream ends (``flush``), so a scrape lags by at
    most a second and no observation is lost.  When the child's layout is not
    the one expected, every observation goes straight to ``observe``.
    """

    __slots__ = ("_child", "_bounds", "_counts", "_sum", "_pending", "_due", "_direct", "interval")

    def __init__(self, child: Histogram, now: float, interval: float = 1.0) -> None:
        self._child = child
        bounds = getattr(child, "_upper_bounds", None)
        buckets = getattr(child, "_buckets", None)
        self._direct = not (isinstance(bounds, list) and isinstance(buckets, list) and len(bounds) == len(buckets)
                            and hasattr(getattr(child, "_sum", None), "inc"))
        self._bounds = bounds
        self._counts = [0] * len(bounds) if not self._direct else []
        self._sum = 0.0
        self._pending = 0
        self.interval = interval
        self._due = now + interval

    def observe(self, amount: float, now: float) -> None:
        if self._direct:
            self._child.observe(amount)
            return
        self._counts[bisect_left(self._bounds, amount)] += 1  # the first bucket with amount <= bound
        self._sum += amount
        self._pending += 1
        if now >= self._due:
            self.flush(now)

    def flush(self, now: float) -> None:
        self._due = now + self.interval
        if not self._pending:
            return
        child = self._child
        counts = self._counts
        for i, n in enumerate(counts):
            if n:
                child._buckets[i].inc(n)
                counts[i] = 0
        child._sum.inc(self._sum)
        self._sum = 0.0
        self._pending = 0
