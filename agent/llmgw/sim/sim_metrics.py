"""Prometheus metrics under vLLM v1's names and labels (vllm/v1/metrics/loggers.py).

vLLM declares counters without the ``_total`` suffix (``vllm:prompt_tokens``);
prometheus_client appends it on the wire, exactly as here.  Labels are
``model_name`` (the first served name) and ``engine`` (the engine index, "0").
Every dialect exposes these vLLM names: the simulator imitates one metrics
surface, not three.  Beside them the SGLang and llama-server dialects expose
their engine's own gauges of the scheduler's state (requests running and
waiting, and SGLang's KV use), the ones an agent reads for autoscaling on an
engine signal (``llmgw.enginesignals``), under the names and labels the pinned
releases use; they move with the vLLM ones (``set_running`` and the others).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST


class SimMetrics:
    def __init__(self, model_name: str, engine: str = "0", dialect: str = "vllm") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "engine"]
        values = (model_name, engine)
        self._values = values

        def gauge(name: str, doc: str):
            return Gauge(name, doc, labels, registry=self.registry).labels(*values)

        def counter(name: str, doc: str):
            return Counter(name, doc, labels, registry=self.registry).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        # New in 0.32: the same queue by reason; the simulator's requests wait only for capacity
        # (a free slot or KV blocks), never for a LoRA budget or a KV transfer ("deferred").
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
            "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
            "status). Sum of all reasons equals vllm:num_requests_waiting.",
            labels + ["reason"], registry=self.registry,
        )
        self.waiting_capacity = by_reason.labels(*values, "capacity")
        by_reason.labels(*values, "deferred").set(0)
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        # vLLM declares this histogram with the _total already in its name (loggers.py):
        # the wire shows vllm:iteration_tokens_total_{bucket,sum,count}.  One engine step
        # per streamed token here; a stuck engine core stops it moving.
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", labels,
            buckets=[1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384], registry=self.registry,
        ).labels(*values)
        # Per request, as vLLM's v1 loggers observe them: latencies (the simulator's own clock) and sizes.
        def histogram(name: str, doc: str, buckets: list[float]):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(*values)

        request_s = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                     240.0, 480.0, 960.0, 1920.0, 7680.0]
        tokens = [1, 2, 5, 10, 20, 50, 100, 200, 500]  # vLLM's 1-2-5 series up to max_model_len
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0])
        self.inter_token = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                     [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                                      7.5, 10.0, 20.0, 40.0, 80.0])
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             request_s)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", request_s)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               tokens)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", tokens)
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20])
        self.params_max_tokens = histogram("vllm:request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", tokens)
        # The simulator never preempts a running request (admission waits for KV space instead):
        # the counter is there, as on vLLM, and stays 0.
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached",
                                            "Number of cached prompt tokens (local + external).")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels + ["finished_reason"],
            registry=self.registry,
        )
        self._success = {r: success.labels(*values, r) for r in ("stop", "length", "abort")}
        self.own = DialectGauges(self.registry, model_name, dialect)

    def set_running(self, n: int) -> None:
        self.running.set(n)
        if self.own.running is not None:
            self.own.running.set(n)

    def set_waiting(self, n: int) -> None:
        self.waiting.set(n)
        self.waiting_capacity.set(n)
        if self.own.waiting is not None:
            self.own.waiting.set(n)

    def set_kv_usage(self, share: float) -> None:
        self.kv_cache_usage.set(share)
        if self.own.kv_usage is not None:
            self.own.kv_usage.set(share)

    def nixl(self) -> "NixlMetrics":
        """vLLM's NIXL connector metrics (kv_connector/v1/nixl/stats.py), registered only with a connector."""
        return NixlMetrics(self.registry, self._values)

    def sglang_disagg(self, mode: str) -> "SGLangDisaggMetrics":
        """SGLang's PD-disaggregation metrics for a ``prefill`` or ``decode`` server (sim_disagg_sglang)."""
        return SGLangDisaggMetrics(self.registry, self._values[0], mode)

    def interference(self) -> "InterferenceMetrics":
        """The simulator's own counts of prefill chunks and the decode steps they stalled (sim_interference)."""
        return InterferenceMetrics(self.registry, self._values)

    def finished(self, reason: str) -> None:
        child = self._success.get(reason)
        if child is not None:
            child.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class NixlMetrics:
    """The NIXL metrics a router reads for transfer time and failures, under vLLM's names."""

    def __init__(self, registry: CollectorRegistry, values: tuple[str, str]) -> None:
        labels = ["model_name", "engine"]
        self.xfer_time = Histogram(
            "vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.", labels,
            buckets=[0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0], registry=registry,
        ).labels(*values)
        self.failed = Counter(
            "vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers, including handshake and "
            "notification failures. NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.",
            labels, registry=registry).labels(*values)
        self.expired = Counter(
            "vllm:nixl_num_kv_expired_reqs", "Number of requests that had their KV expire. NOTE: This metric is "
            "tracked on the P instance.", labels, registry=registry).labels(*values)


class InterferenceMetrics:
    """Simulator-only counters (no vLLM equivalent) of prefill/decode interference."""

    def __init__(self, registry: CollectorRegistry, values: tuple[str, str]) -> None:
        labels = ["model_name", "engine"]
        self.chunks = Counter("llmgw_sim:prefill_chunks", "Engine steps that carried a prefill chunk.",
                              labels, registry=registry).labels(*values)
        self.stalled = Counter("llmgw_sim:decode_steps_stalled",
                               "Decode steps of running requests delayed by a prefill chunk in the same step.",
                               labels, registry=registry).labels(*values)


class SGLangDisaggMetrics:
    """SGLang 0.5.23's PD-disaggregation metrics (srt/observability/metrics_collector.py), names, buckets and
    labels as its scheduler registers them, so a router reads a simulated pair as it reads a real one.

    SGLang registers every one of them on prefill and decode servers alike; each side moves its own.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str, mode: str) -> None:
        labels = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"]
        values = (model_name, mode, "0", "0", "0")

        def gauge(name: str, doc: str):
            return Gauge(name, doc, labels, registry=registry).labels(*values)

        def counter(name: str, doc: str):
            return Counter(name, doc, labels, registry=registry).labels(*values)

        self.bootstrap_queue = gauge("sglang:num_prefill_bootstrap_queue_reqs",
                                     "The number of requests in the prefill bootstrap queue.")
        self.inflight_queue = gauge("sglang:num_prefill_inflight_queue_reqs",
                                    "The number of requests in the prefill inflight queue.")
        self.transfer_queue = gauge("sglang:num_decode_transfer_queue_reqs",
                                    "The number of requests in the decode transfer queue.")
        self.bootstrap_failed = counter("sglang:num_bootstrap_failed_reqs_total",
                                        "The number of bootstrap failed requests.")
        self.transfer_failed = counter("sglang:num_transfer_failed_reqs_total",
                                       "The number of transfer failed requests.")
        self.transfer_latency_ms = Histogram(
            "sglang:kv_transfer_latency_ms", "Histogram of KV cache transfer latency in ms.", labels,
            buckets=[1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000], registry=registry,
        ).labels(*values)


class DialectGauges:
    """The scheduler gauges of the dialect's own engine, None where it has none (vLLM's are SimMetrics' own).

    SGLang 0.5.23 (srt/observability/metrics_collector.py): ``sglang:num_running_reqs``,
    ``sglang:num_queue_reqs``, ``sglang:token_usage``, labelled as its scheduler labels them
    (engine_type "unified" outside a prefill/decode pair). llama-server (tools/server/server.cpp):
    ``llamacpp:requests_processing``, ``llamacpp:requests_deferred``, no labels; it has no KV-use gauge.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str, dialect: str) -> None:
        self.running = self.waiting = self.kv_usage = None
        if dialect == "sglang":
            labels = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"]
            values = (model_name, "unified", "0", "0", "0")

            def gauge(name: str, doc: str):
                return Gauge(name, doc, labels, registry=registry).labels(*values)

            self.running = gauge("sglang:num_running_reqs", "The number of running requests.")
            self.waiting = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
            self.kv_usage = gauge("sglang:token_usage", "The token usage.")
        elif dialect == "llamacpp":
            self.running = Gauge("llamacpp:requests_processing", "Number of requests processing.",
                                 registry=registry)
            self.waiting = Gauge("llamacpp:requests_deferred", "Number of requests deferred.", registry=registry)
