"""Simulator-only settings, read from the environment so argv stays the engine's.

=============================== ======= =============================================
variable                        default meaning
=============================== ======= =============================================
LLMGW_SIM_STARTUP_DELAY         0       seconds of "loading" before the port listens
LLMGW_SIM_TOKEN_LATENCY         0       seconds per generated token (one request alone)
LLMGW_SIM_DECODE_BATCH_SLOWDOWN 0       how much longer each token takes per other running
                                        request: token latency x (1 + this x (running - 1))
LLMGW_SIM_PREFILL_TOKEN_LATENCY 0       seconds of prefill per prompt token not found in the
                                        prefix cache, before the first token
LLMGW_SIM_KV_TRANSFER_TOKEN_LATENCY 0   seconds per prompt token a decoder pulls from a
                                        remote prefill (--kv-transfer-config, sim_disagg;
                                        SGLang's --disaggregation-mode, sim_disagg_sglang)
LLMGW_SIM_PREFILL_INTERFERENCE  1       1: prompts prefill one at a time, in chunks of
                                        --max-num-batched-tokens, each chunk delaying the
                                        decode steps of the engine's running requests
                                        (sim_interference); 0: prefills side by side, no stall
LLMGW_SIM_TIMING                (none)  a named preset of fitted timing figures (the three
                                        above; explicit ones win), see sim_timing.py
LLMGW_SIM_OUTPUT_TOKENS         16      tokens generated when a request sets no max_tokens
LLMGW_SIM_EMBED_DIM             16      embedding dimensions
LLMGW_SIM_PREFIX_CACHE_BLOCKS   4096    KV-cache size in blocks (vLLM's num_gpu_blocks, one
                                        of them the null block); it bounds the prefix cache
                                        and the running batch; --num-gpu-blocks-override wins
LLMGW_SIM_MAX_MODEL_LEN         8192    context length when --max-model-len is absent
                                        (stands in for the model's config.json)
LLMGW_SIM_SLEEP_TIME            0.1     seconds POST /sleep takes (``--enable-sleep-mode``)
LLMGW_SIM_WAKE_TIME             0.3     seconds POST /wake_up takes after a level-1 sleep
                                        (weights copied back from host memory)
LLMGW_SIM_WAKE_TIME_LEVEL2      2.0     seconds POST /wake_up takes after a level-2 sleep
                                        (weights were dropped: read again)
LLMGW_SIM_FAULT                 (none)  one injected failure, see below
LLMGW_SIM_FAULT_ONSET           start   when the fault begins: ``start``, ``after:N``
                                        (N seconds after the port listens) or
                                        ``signal`` (on SIGUSR1)
=============================== ======= =============================================

Faults: ``exit-during-start`` (exit 1 after an engine-core traceback, port never
listens), ``crash-after:N`` (the process dies abruptly once a request has
streamed N tokens), ``hang`` (/health answers 200, completions never produce a
token), ``error-chunk-after:N`` (a stream carries an in-band error after N
tokens, then ``[DONE]``), ``http-500`` (every completion answers 500).

Two more imitate a replica that served and then went bad, as vLLM does:
``wedge`` (the process lives, but no route answers any more, ``/health`` and
``/metrics`` included: an API server whose event loop is stuck) and
``engine-dead`` (``/health`` and every ``/v1`` request answer 500, as vLLM's
API server does once its engine core died: ``EngineDeadError``).  ``kv-transfer-fail``
makes a prefill engine's side channel refuse every pull (a broken fabric; sim_disagg), and fails every
SGLang transfer to or from the engine (sim_disagg_sglang).  A ``hang``
that begins after start is vLLM's engine core stuck in a collective: ``/health``
still 200 (it only checks that the core has not errored), new requests queue
and ``vllm:iteration_tokens_total`` stops moving.  With a later onset, requests
already streaming when the fault begins finish; only new ones are affected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from llmgw.sim.sim_timing import expand

FAULTS = ("exit-during-start", "crash-after", "hang", "error-chunk-after", "http-500", "wedge", "engine-dead",
          "kv-transfer-fail")
_COUNTED = ("crash-after", "error-chunk-after")


class KnobError(ValueError):
    """An LLMGW_SIM_* variable with a value the simulator cannot use."""


@dataclass(frozen=True)
class Fault:
    kind: str | None = None  # None: healthy
    after: int = 0  # tokens before the fault, for the counted kinds
    onset: str = "start"  # "start", "after" (onset_after seconds after listening) or "signal" (SIGUSR1)
    onset_after: float = 0.0

    def __bool__(self) -> bool:
        return self.kind is not None


@dataclass(frozen=True)
class Knobs:
    startup_delay: float = 0.0
    token_latency: float = 0.0
    decode_batch_slowdown: float = 0.0
    prefill_token_latency: float = 0.0
    kv_transfer_token_latency: float = 0.0
    prefill_interference: bool = True
    output_tokens: int = 16
    embed_dim: int = 16
    prefix_cache_blocks: int = 4096
    max_model_len: int = 8192
    sleep_time: float = 0.1
    wake_time: float = 0.3
    wake_time_level2: float = 2.0
    fault: Fault = Fault()


def parse_fault(value: str) -> Fault:
    value = value.strip()
    if not value or value == "none":
        return Fault()
    kind, sep, arg = value.partition(":")
    if kind not in FAULTS:
        raise KnobError(
            f"LLMGW_SIM_FAULT={value!r}: unknown fault {kind!r}; known: "
            + ", ".join(f + (":N" if f in _COUNTED else "") for f in FAULTS)
        )
    if kind in _COUNTED:
        if not sep or not arg.isdigit():
            raise KnobError(f"LLMGW_SIM_FAULT={value!r}: {kind} needs a token count, e.g. {kind}:5")
        return Fault(kind, int(arg))
    if sep:
        raise KnobError(f"LLMGW_SIM_FAULT={value!r}: {kind} takes no argument")
    return Fault(kind)


def parse_onset(value: str, fault: Fault) -> Fault:
    """``LLMGW_SIM_FAULT_ONSET``: ``start`` | ``after:N`` | ``signal``, applied to ``fault``."""
    v = value.strip()
    if not v or v == "start":
        return fault
    if v == "signal":
        onset, after = "signal", 0.0
    elif v.startswith("after:"):
        try:
            after = float(v[len("after:"):])
        except ValueError:
            after = -1.0
        if not math.isfinite(after) or after < 0:
            raise KnobError(f"LLMGW_SIM_FAULT_ONSET={value!r}: after needs seconds >= 0, e.g. after:5")
        onset = "after"
    else:
        raise KnobError(f"LLMGW_SIM_FAULT_ONSET={value!r}: known: start, after:N, signal")
    if fault.kind is None:
        raise KnobError(f"LLMGW_SIM_FAULT_ONSET={value!r}: no LLMGW_SIM_FAULT to begin")
    if fault.kind == "exit-during-start":
        raise KnobError(f"LLMGW_SIM_FAULT_ONSET={value!r}: exit-during-start can only begin at start")
    return Fault(fault.kind, fault.after, onset, after)


def _number(env: Mapping[str, str], name: str, default: float, *, integer: bool, minimum: float):
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise KnobError(f"{name}={raw!r}: must be {kind}") from None
    if not math.isfinite(value) or value < minimum:
        raise KnobError(f"{name}={raw!r}: must be >= {minimum:g}")
    return value


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    if raw in ("1", "0"):
        return raw == "1"
    raise KnobError(f"{name}={raw!r}: must be 0 or 1")


def knobs_from_env(env: Mapping[str, str]) -> Knobs:
    try:
        env = expand(env)
    except ValueError as e:
        raise KnobError(str(e)) from None
    return Knobs(
        startup_delay=_number(env, "LLMGW_SIM_STARTUP_DELAY", 0.0, integer=False, minimum=0),
        token_latency=_number(env, "LLMGW_SIM_TOKEN_LATENCY", 0.0, integer=False, minimum=0),
        decode_batch_slowdown=_number(env, "LLMGW_SIM_DECODE_BATCH_SLOWDOWN", 0.0, integer=False, minimum=0),
        prefill_token_latency=_number(env, "LLMGW_SIM_PREFILL_TOKEN_LATENCY", 0.0, integer=False, minimum=0),
        kv_transfer_token_latency=_number(env, "LLMGW_SIM_KV_TRANSFER_TOKEN_LATENCY", 0.0, integer=False,
                                          minimum=0),
        prefill_interference=_flag(env, "LLMGW_SIM_PREFILL_INTERFERENCE", True),
        output_tokens=_number(env, "LLMGW_SIM_OUTPUT_TOKENS", 16, integer=True, minimum=1),
        embed_dim=_number(env, "LLMGW_SIM_EMBED_DIM", 16, integer=True, minimum=1),
        prefix_cache_blocks=_number(env, "LLMGW_SIM_PREFIX_CACHE_BLOCKS", 4096, integer=True, minimum=2),
        max_model_len=_number(env, "LLMGW_SIM_MAX_MODEL_LEN", 8192, integer=True, minimum=1),
        sleep_time=_number(env, "LLMGW_SIM_SLEEP_TIME", 0.1, integer=False, minimum=0),
        wake_time=_number(env, "LLMGW_SIM_WAKE_TIME", 0.3, integer=False, minimum=0),
        wake_time_level2=_number(env, "LLMGW_SIM_WAKE_TIME_LEVEL2", 2.0, integer=False, minimum=0),
        fault=parse_onset(env.get("LLMGW_SIM_FAULT_ONSET", ""), parse_fault(env.get("LLMGW_SIM_FAULT", ""))),
    )
