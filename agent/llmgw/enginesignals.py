"""The engines' own autoscaling signals: which gauge each engine exposes, and reading it from ``/metrics``.

``autoscale.signal: queue_depth`` is the requests an engine holds waiting for a
batch slot or KV space; ``kv_cache_use`` the share of its KV cache in use (0-1).
Names as the pinned releases register them (docs/autoscaling.md lists where):

- vLLM 0.33 (``v1/metrics/loggers.py``): ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (a fraction despite its name; builds before the
  v1 engine called it ``vllm:gpu_cache_usage_perc``, read when the new one is absent);
- SGLang 0.5.23 (``srt/observability/metrics_collector.py``): ``sglang:num_queue_reqs``,
  ``sglang:token_usage`` (the fullest of its KV pools);
- llama.cpp's server: ``llamacpp:requests_deferred`` (requests waiting for a free
  slot); it exports no KV-cache use, so ``kv_cache_use`` is refused on it.

One page can hold several series of a name: one per engine core under vLLM's data
parallelism (label ``engine``), one per DP rank under SGLang, and with SGLang's
priority scheduling a per-priority breakdown beside the total (``priority="N"``
beside ``priority=""``), which is left out so nothing counts twice.  Requests
waiting add up over the engines behind one server; KV use is the fullest engine's,
the one that queues first.

Pure: text in, a number out; used by the agent (``agent/enginesignals``) and by the
catalog's checks (an engine signal on an engine that has none is refused).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from llmgw import promtext

QUEUE_DEPTH = "queue_depth"
KV_CACHE_USE = "kv_cache_use"
ENGINE_SIGNALS = (QUEUE_DEPTH, KV_CACHE_USE)
# The most a value may be on the stream (its schema's bound): a page claiming more is read as this
# much, since a message the control plane's schema refuses would close the agent's stream.
MAX_VALUE = 1_000_000.0

# signal -> engine -> the gauge names to read, the first present on the page wins
NAMES: Mapping[str, Mapping[str, tuple[str, ...]]] = {
    QUEUE_DEPTH: {
        "vllm": ("vllm:num_requests_waiting",),
        "sglang": ("sglang:num_queue_reqs",),
        "llamacpp": ("llamacpp:requests_deferred",),
    },
    KV_CACHE_USE: {
        "vllm": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "sglang": ("sglang:token_usage",),
    },
}

_BREAKDOWN = re.compile(r'priority="[^"]')  # SGLang's per-priority series beside its total


def engines_for(signal: str) -> tuple[str, ...]:
    """The engines that expose ``signal`` (empty for a signal that is not an engine's)."""
    return tuple(sorted(NAMES.get(signal, {})))


def read_signal(text: str, engine: str, signal: str) -> float | None:
    """``signal``'s value on one ``/metrics`` page of ``engine``; None when the page does not show it."""
    for name in NAMES.get(signal, {}).get(engine, ()):
        values = [v for _, labels, v in promtext.samples(text, (name,))
                  if not _BREAKDOWN.search(labels) and math.isfinite(v) and v >= 0]
        if values:
            return min(MAX_VALUE, sum(values) if signal == QUEUE_DEPTH else max(values))
    return None
