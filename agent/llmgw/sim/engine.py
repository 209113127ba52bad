"""``llmgw-engine-sim``: an inference engine without a GPU, for tests, demos, benchmarks.

It takes the engine's own command line (``llmgw-engine-sim serve MODEL
[vLLM flags]``, or the ``sglang`` / ``llama-server`` dialects, see sim_args),
so an engine profile runs against it unchanged with only the binary replaced,
and answers vLLM's OpenAI-compatible HTTP API.  Start-up follows vLLM's order:
the port is reserved (bound, not listening) before the weights "load", and
opens only when the server is ready, so a client probing during start-up sees
connection refused, as it would against the real engine.  Worker ranks
(``--headless``) serve nothing and stay alive until stopped.

Simulator-only behaviour (latencies, injected faults) comes from LLMGW_SIM_*
environment variables (sim_knobs), never from argv.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import signal
import socket
import ssl
import sys
import time
from typing import Sequence

from aiohttp import web

from llmgw import compat
from llmgw.sim.sim_args import ArgvError, SimConfig, parse_argv
from llmgw.sim.sim_http import SIM_VERSION, SimState, build_app
from llmgw.sim.sim_knobs import KnobError, Knobs, knobs_from_env
from llmgw.sim.sim_kvpublish import KVEventPublisher, PublisherError, load_zmq

PROG = "llmgw-engine-sim"


class Log:
    """Log lines in vLLM's format: ``INFO 12-02 17:30:00 [file.py:123] message``."""

    def __init__(self, component: str = "APIServer") -> None:
        self.prefix = f"({component} pid={os.getpid()}) "

    def _line(self, level: str, where: str, msg: str, stream=None) -> None:
        stream = stream or sys.stdout
        stream.write(f"{self.prefix}{level} {time.strftime('%m-%d %H:%M:%S')} [{where}] {msg}\n")
        stream.flush()

    def info(self, where: str, msg: str) -> None:
        self._line("INFO", where, msg)

    def error(self, where: str, msg: str) -> None:
        self._line("ERROR", where, msg, sys.stderr)


def _engine_core_failure(log: Log) -> None:
    """The tail of a vLLM engine-core start-up failure, as an operator would see it."""
    where = "core.py:708"
    lines = [
        "EngineCore failed to start.",
        "Traceback (most recent call last):",
        '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core.py", line 699, in run_engine_core',
        "    engine_core = EngineCoreProc(*args, **kwargs)",
        '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core.py", line 498, in __init__',
        "    super().__init__(vllm_config, executor_class, log_stats,",
        '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core.py", line 92, in __init__',
        "    self._initialize_kv_caches(vllm_config)",
        '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core.py", line 190, in _initialize_kv_caches',
        "    available_gpu_memory = self.model_executor.determine_available_memory()",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.75 GiB. GPU 0 has a total "
        "capacity of 79.19 GiB of which 1.02 GiB is free. Including non-PyTorch memory, this process "
        "has 78.16 GiB memory in use.",
    ]
    for line in lines:
        log.error(where, line)
    sys.stderr.write(
        "RuntimeError: Engine core initialization failed. See root cause above. "
        "Failed core proc(s): {'EngineCore_DP0': 1}\n"
    )
    sys.stderr.flush()


def _bind(cfg: SimConfig) -> socket.socket:
    """Reserve the port before loading, as vLLM does; it listens only when ready.

    vLLM also sets SO_REUSEPORT (for multiple API server processes); the
    simulator does not, so two simulators given one port fail loudly instead
    of silently sharing it.
    """
    host = cfg.host or ""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, cfg.port))
    except OSError:
        sock.close()
        raise
    return sock


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds`` unless stopped first; True when stopped."""
    if seconds <= 0:
        return stop.is_set()
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
        return True
    except asyncio.TimeoutError:
        return False


async def _headless(cfg: SimConfig, knobs: Knobs, stop: asyncio.Event, log: Log) -> int:
    if await _wait(stop, knobs.startup_delay):
        return 0
    if knobs.fault.kind == "exit-during-start":
        _engine_core_failure(log)
        return 1
    if cfg.dialect == "sglang":
        log.info("scheduler.py:2508", f"node rank {cfg.node_rank}/{cfg.nnodes}: scheduler ready, "
                 f"dist init address {cfg.master_addr}:{cfg.master_port}; serving no HTTP")
    else:
        log.info(
            "serve.py:226",
            f"Launching vLLM (v{SIM_VERSION}) headless multiproc executor, with head node "
            f"address {cfg.master_addr}:{cfg.master_port} for torch.distributed process group.",
        )
    await stop.wait()
    log.info("serve.py:260", "Shutting down.")
    return 0


def _ssl_context(cfg: SimConfig) -> ssl.SSLContext | None:
    """The serving context for ``--ssl-keyfile``/``--ssl-certfile``, as uvicorn builds it; None: plain HTTP.

    Loaded before the port is bound, so a bad pair fails the start at once, as vLLM does.
    """
    if not (cfg.ssl_keyfile or cfg.ssl_certfile):
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cfg.ssl_certfile or "", cfg.ssl_keyfile)
    return ctx


async def serve(cfg: SimConfig, knobs: Knobs) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log = Log()
    log.info("api_server.py:1839", f"vLLM API server version {SIM_VERSION}")
    log.info("utils.py:233", f"non-default args: {cfg.non_default}")
    if cfg.headless:
        return await _headless(cfg, knobs, stop, log)

    try:
        ssl_context = _ssl_context(cfg)
    except (OSError, ssl.SSLError) as e:
        sys.stderr.write(f"ssl.SSLError: cannot load --ssl-certfile/--ssl-keyfile: {e}\n")
        sys.stderr.flush()
        return 1
    try:
        sock = _bind(cfg)
    except OSError as e:
        sys.stderr.write(f"OSError: [Errno {e.errno}] {e.strerror}: {cfg.host or '0.0.0.0'}:{cfg.port}\n")
        sys.stderr.flush()
        return 1
    try:
        tp, pp = cfg.tensor_parallel_size, cfg.pipeline_parallel_size
        log.info("model.py:547", f"Resolved architecture: SimulatedForCausalLM ({cfg.model})")
        log.info("model.py:1510", f"Using max model len {cfg.max_model_len or knobs.max_model_len}")
        log.info("parallel.py:488", f"world size {tp * pp} (tp={tp}, pp={pp}) over {cfg.nnodes} node(s)")
        log.info("gpu_model_runner.py:2602", "Starting to load model " + cfg.model + "...")
        if await _wait(stop, knobs.startup_delay):
            return 0
        if knobs.fault.kind == "exit-during-start":
            _engine_core_failure(log)
            return 1
        log.info("default_loader.py:267", f"Loading weights took {knobs.startup_delay:.2f} seconds")
        blocks = cfg.num_gpu_blocks or knobs.prefix_cache_blocks
        log.info("kv_cache_utils.py:1087", f"GPU KV cache size: {blocks * cfg.block_size:,} tokens")
        publisher = None
        if cfg.kv_events is not None:
            try:
                publisher = KVEventPublisher(cfg.kv_events)
            except PublisherError as e:
                log.error("kv_events.py:352", str(e))
                sys.stderr.write(f"RuntimeError: {e}\n")
                sys.stderr.flush()
                return 1
            log.info("kv_events.py:398", "Starting ZMQ publisher thread")
            publisher.start()

        state = SimState(cfg, knobs, publisher)
        if state.transfers is not None:
            try:
                await state.transfers.start()
            except OSError as e:
                sys.stderr.write(f"RuntimeError: NIXL side channel {state.transfers.host}:{state.transfers.port}: "
                                 f"{e.strerror or e}\n")
                sys.stderr.flush()
                return 1
            log.info("nixl_connector.py:412", f"NIXL side channel for engine {state.transfers.engine_id} "
                     f"({cfg.kv_transfer.role}) on {state.transfers.host}:{state.transfers.port}")
        if state.pd is not None and not await _start_pd(state, cfg, log):
            return 1
        # In-flight requests get a short grace on SIGTERM, then are cancelled.
        runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None,
                               shutdown_timeout=1.0)
        await runner.setup()
        site = web.SockSite(runner, sock, ssl_context=ssl_context)
        await site.start()
        _arm_fault(loop, state, knobs)
    except BaseException:
        sock.close()
        raise
    host = cfg.host or "0.0.0.0"
    scheme = "https" if ssl_context is not None else "http"
    log.info("api_server.py:1912", f"Starting vLLM API server 0 on {scheme}://{host}:{cfg.port}")
    log.info("launcher.py:34", "Available routes are: /health, /ping, /load, /v1/models, /metrics, /version, "
             "/v1/chat/completions, /v1/completions, /v1/embeddings")
    if cfg.dialect == "sglang":
        log.info("http_server.py:1214", "The server is fired up and ready to roll!")
    elif cfg.dialect == "llamacpp":
        log.info("server.cpp:5481",
                 f"main: server is listening on {scheme}://{host}:{cfg.port} - starting the main loop")
    sys.stdout.write("INFO:     Application startup complete.\n")
    sys.stdout.flush()
    await stop.wait()
    sys.stdout.write("INFO:     Shutting down\n")
    sys.stdout.flush()
    await runner.cleanup()
    if state.transfers is not None:
        await state.transfers.close()
    if state.pd is not None:
        await state.pd.close()
    if publisher is not None:
        publisher.close()
    return 0


async def _start_pd(state: SimState, cfg: SimConfig, log: Log) -> bool:
    """Start an SGLang prefill server's bootstrap server (sim_disagg_sglang); False when it cannot listen."""
    pd, mode = state.pd, cfg.disaggregation
    assert pd is not None and mode is not None
    try:
        if pd.server is not None and mode.bootstrap_port == cfg.port:  # the API server's port, bound already
            raise OSError(errno.EADDRINUSE, "address already in use (it is --port)")
        await pd.start()
    except OSError as e:
        sys.stderr.write(f"RuntimeError: bootstrap server {cfg.host or '0.0.0.0'}:{mode.bootstrap_port}: "
                         f"{e.strerror or e}\n")
        sys.stderr.flush()
        return False
    log.info("disagg_service.py:43", f"PD disaggregation: mode {mode.mode}, transfer backend "
             f"{mode.transfer_backend}, SGLANG_HOST_IP {pd.host_ip or '(unset: guessed)'}, "
             f"bootstrap timeout {pd.timeouts.bootstrap:g}s, waiting timeout {pd.timeouts.waiting:g}s")
    if pd.server is not None:
        log.info("conn.py:3052", f"bootstrap server on {cfg.host or '0.0.0.0'}:{mode.bootstrap_port}")
    return True


def _arm_fault(loop: asyncio.AbstractEventLoop, state: SimState, knobs: Knobs) -> None:
    """Schedule a fault whose onset is later than start (LLMGW_SIM_FAULT_ONSET)."""
    if knobs.fault.onset == "after":
        loop.call_later(knobs.fault.onset_after, state.begin_fault)
    elif knobs.fault.onset == "signal":
        loop.add_signal_handler(signal.SIGUSR1, state.begin_fault)


def _run(cfg: SimConfig, knobs: Knobs) -> int:
    try:
        import uvloop  # optional: the benchmarks' upstream runs on it when present
        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    return compat.run(serve(cfg, knobs), loop_factory=factory)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse_argv(argv, prog=PROG)
    except ArgvError as e:
        sys.stderr.write(f"ValueError: {e}\n")
        return 1
    try:
        knobs = knobs_from_env(os.environ)
    except KnobError as e:
        sys.stderr.write(f"{PROG}: {e}\n")
        return 2
    if cfg.kv_events is not None:
        try:
            load_zmq()  # before anything starts: the flag is useless without it
        except PublisherError as e:
            sys.stderr.write(f"{PROG}: {e}\n")
            return 1
    if cfg.dialect == "vllm" and not cfg.api_keys and os.environ.get("VLLM_API_KEY"):
        cfg = dataclasses.replace(cfg, api_keys=(os.environ["VLLM_API_KEY"],))
    return _run(cfg, knobs)


if __name__ == "__main__":
    sys.exit(main())
