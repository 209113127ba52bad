"""SGLang: ``python -m sglang.launch_server --model-path <model> ...``.

Flag names follow SGLang's python/sglang/srt/server_args.py (``add_cli_args``),
which accepts two spellings for most parallelism flags (``--tp-size`` /
``--tensor-parallel-size``, ``--model-path`` / ``--model``,
``--dist-init-addr`` / ``--nccl-init-addr``); both are owned.

Multi-node: every node runs the same command with ``--nnodes K --node-rank R
--dist-init-addr <rank-0 address>:<port>``; ``--tp-size`` is the total across
nodes.  Only rank 0 serves HTTP (SGLang's other ranks run schedulers only),
so worker ranks are checked by liveness.  ``--base-gpu-id``/``--gpu-id-step``
are owned because they index into CUDA_VISIBLE_DEVICES, which the adapter sets
from the shard's GPUs.

The engine key: SGLang reads ``--api-key`` from its arguments only (no
environment variable in server_args.py), but it merges a YAML ``--config``
file into them inside the process (server_args_config_parser.py).  So the
adapter writes ``api-key: <key>`` to a 0600 file in the shard's private
directory and passes ``--config <file>``: the key never shows in ``ps``.
``--config`` was already owned, so a profile cannot bring its own.

No TLS: the pinned release (0.5.5) has no ``--ssl-*`` flags (its uvicorn is
started without any), so an SGLang rank 0 serves plain HTTP on the node's
fleet address even when the agent has an engine certificate, and the
control plane shows its endpoint as ``http://``.
"""

from __future__ import annotations

import os

from llmgw.catalog import Model, Profile
from llmgw.engines.base import LaunchContext, LaunchContextError, SecretFile
from llmgw.engines.common import (
    ARGPARSE,
    USE_GPUS,
    USE_HOST,
    USE_KEY,
    USE_LISTED,
    USE_MAX_LEN,
    USE_NODES,
    USE_PLACEMENT,
    USE_PORT,
    USE_PP,
    USE_REPLICAS,
    USE_SERVED,
    USE_SOURCE,
    USE_TP,
    Adapter,
    OwnedFlag,
)

_OWNED = (
    OwnedFlag(("--model-path", "--model"), USE_SOURCE),
    OwnedFlag(("--host",), USE_HOST),
    OwnedFlag(("--port",), USE_PORT),
    OwnedFlag(("--served-model-name",), USE_SERVED),
    OwnedFlag(("--tp-size", "--tensor-parallel-size"), USE_TP),
    OwnedFlag(("--pp-size", "--pipeline-parallel-size"), USE_PP),
    OwnedFlag(("--dp-size", "--data-parallel-size"), USE_REPLICAS),
    OwnedFlag(("--nnodes",), USE_NODES),
    OwnedFlag(("--node-rank",), USE_PLACEMENT),
    OwnedFlag(("--dist-init-addr", "--nccl-init-addr"), USE_PLACEMENT),
    OwnedFlag(("--base-gpu-id",), USE_GPUS),
    OwnedFlag(("--gpu-id-step",), USE_GPUS),
    OwnedFlag(("--grpc-mode",), "the router speaks OpenAI HTTP to rank 0"),
    OwnedFlag(("--config",), USE_LISTED),
)


class SGLangAdapter(Adapter):
    name = "sglang"
    default_command = ("python", "-m", "sglang.launch_server")
    syntax = ARGPARSE
    key_flags = (OwnedFlag(("--api-key",), USE_KEY),)
    memory_fraction_flag = "--mem-fraction-static"

    def key_launch(self, ctx: LaunchContext) -> tuple[list[str], dict[str, str], tuple[SecretFile, ...]]:
        if not ctx.api_key or not self.serves_http(ctx):
            return [], {}, ()
        if not ctx.secret_dir:
            raise LaunchContextError("SGLang takes its engine key from a --config file: secret_dir is required")
        path = os.path.join(ctx.secret_dir, "sglang-config.yaml")
        # the key is URL-safe base64 (no YAML specials), quoted anyway
        return ["--config", path], {}, (SecretFile(path, f'api-key: "{ctx.api_key}"\n'),)

    def owned_flags(self, profile: Profile) -> tuple[OwnedFlag, ...]:
        return _OWNED

    def model_owned_flags(self, model: Model) -> tuple[OwnedFlag, ...]:
        if model.max_model_len is not None:
            return (OwnedFlag(("--context-length",), USE_MAX_LEN),)
        return ()

    def engine_args(self, model: Model, profile: Profile, ctx: LaunchContext) -> list[str]:
        args = [
            "--model-path", ctx.model_path,
            "--host", ctx.host,
            "--port", str(ctx.port),
            "--served-model-name", model.served_name,
            "--tp-size", str(profile.tensor_parallel_size),
            # /metrics, which liveness reads for progress: without it every check
            # would be a completion queued behind the engine's own requests.
            "--enable-metrics",
        ]
        if profile.pipeline_parallel_size > 1:
            args += ["--pp-size", str(profile.pipeline_parallel_size)]
        if model.max_model_len is not None:
            args += ["--context-length", str(model.max_model_len)]
        if ctx.nnodes > 1:
            if ctx.master_port is None:
                raise LaunchContextError(
                    "SGLang multi-node needs master_port: --dist-init-addr is host:port"
                )
            args += [
                "--nnodes", str(ctx.nnodes),
                "--node-rank", str(ctx.rank),
                "--dist-init-addr", _host_port(str(ctx.master_addr), ctx.master_port),
            ]
        return args


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


ADAPTER = SGLangAdapter()
