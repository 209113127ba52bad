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

No TLS yet: an SGLang rank 0 serves plain HTTP on the node's fleet address
even when the agent has an engine certificate, and the control plane shows its
endpoint as ``http://``.  SGLang has had ``--ssl-keyfile``/``--ssl-certfile``
(and ``--ssl-ca-certs``, ``--ssl-keyfile-password``, ``--enable-ssl-refresh``)
since before the pinned 0.5.23; they are owned, because an engine a profile
switched to HTTPS would be probed and routed to over HTTP and never be Ready.

Reserved for llmgw: ``--kv-events-config`` (the KV event publisher, whose
endpoint the agent chooses) with ``--load-publish-endpoint`` (the load feed
that needs that publisher and binds a wildcard TCP address), and the flags that make a replica one side of
prefill/decode disaggregation, SGLang's counterpart of vLLM's
``--kv-transfer-config``: ``--disaggregation-mode`` (its role),
``--disaggregation-transfer-backend`` (the connector),
``--disaggregation-bootstrap-port`` (a port on the prefill node) and
``--disaggregation-ib-device`` (its NICs); the decode-side tuning flags
(``--disaggregation-decode-*``) stay the profile's.  ``--smg-grpc-mode``
replaced ``--grpc-mode`` (kept as a deprecated alias): both are owned.

One side of a prefill/decode pair (a profile with ``kv_transfer``, derived
from a deployment's ``disaggregation``): ``--disaggregation-mode prefill`` or
``decode`` and ``--disaggregation-transfer-backend nixl``; a prefill replica's
bootstrap server (where decoders ask for a request's KV, on ``--host``) on the
port the agent allocates for the replica's side channel, which the control
plane publishes with the endpoint so the router can name it in each request's
``bootstrap_port``.  ``SGLANG_HOST_IP`` is the node's address: SGLang's KV
manager binds and advertises it for the transfer itself (else it guesses an
interface).  ``--disaggregation-ib-device`` stays unset: for NIXL over UCX a
non-empty ``UCX_NET_DEVICES``, which placement derives from the shared
fabric's ports nearest the GPUs, takes precedence over it (SGLang's own help).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from llmgw import kvbootstrap
from llmgw.catalog import Model, Profile
from llmgw.engines.base import LaunchContext, LaunchContextError, SecretFile
from llmgw.engines.common import (
    ARGPARSE,
    USE_GPUS,
    USE_HOST,
    USE_HTTP,
    USE_KEY,
    USE_KV_EVENTS,
    USE_KV_TRANSFER,
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

KV_MODES = {"prefill": "prefill", "decode": "decode"}  # --disaggregation-mode per KVTransfer.role
KV_BACKENDS = {"nixl": "nixl"}  # --disaggregation-transfer-backend per connector
HOST_IP_ENV = "SGLANG_HOST_IP"
USE_HOST_IP = ("the KV-transfer address of a prefill/decode replica is the agent's: the node's address")

_USE_NO_TLS = ("llmgw runs SGLang over plain HTTP (its endpoint is http://), so an engine switched to HTTPS "
               "would never pass the agent's probe")

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
    OwnedFlag(("--smg-grpc-mode",), USE_HTTP),
    OwnedFlag(("--grpc-mode",), USE_HTTP),
    OwnedFlag(("--ssl-keyfile",), _USE_NO_TLS),
    OwnedFlag(("--ssl-certfile",), _USE_NO_TLS),
    OwnedFlag(("--ssl-ca-certs",), _USE_NO_TLS),
    OwnedFlag(("--ssl-keyfile-password",), _USE_NO_TLS),
    OwnedFlag(("--enable-ssl-refresh",), _USE_NO_TLS),
    OwnedFlag(("--kv-events-config",), USE_KV_EVENTS),
    # the runtime-load feed for load-aware routers: it needs a --kv-events-config publisher
    OwnedFlag(("--load-publish-endpoint",), USE_KV_EVENTS),
    OwnedFlag(("--disaggregation-mode",), USE_KV_TRANSFER),
    OwnedFlag(("--disaggregation-transfer-backend",), USE_KV_TRANSFER),
    OwnedFlag(("--disaggregation-bootstrap-port",), USE_KV_TRANSFER),
    OwnedFlag(("--disaggregation-ib-device",), USE_KV_TRANSFER),
    OwnedFlag(("--config",), USE_LISTED),
)


class SGLangAdapter(Adapter):
    name = "sglang"
    default_command = ("python", "-m", "sglang.launch_server")
    syntax = ARGPARSE
    key_flags = (OwnedFlag(("--api-key",), USE_KEY),)
    memory_fraction_flag = "--mem-fraction-static"
    forbidden_env = {HOST_IP_ENV: USE_HOST_IP}
    kv_transfer_capable = True

    def launch_env(self, ctx: LaunchContext) -> dict[str, str]:
        return {HOST_IP_ENV: ctx.kv_side_channel[0]} if ctx.kv_side_channel is not None else {}

    def probe_fields(self, profile: Mapping[str, Any]) -> dict[str, Any]:
        # every other request of a prefill or decode server waits for a peer; this one runs alone
        return dict(kvbootstrap.FAKE) if profile.get("kv_transfer") else {}

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
        if profile.kv_transfer is not None:
            args += disaggregation_args(profile, ctx)
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


def disaggregation_args(profile: Profile, ctx: LaunchContext) -> list[str]:
    """SGLang's flags for one side of a prefill/decode pair (the side channel's port: the prefill's bootstrap)."""
    kv = profile.kv_transfer
    assert kv is not None
    if ctx.kv_side_channel is None:
        raise LaunchContextError(f"profile {profile.name!r} is one side of a prefill/decode pair: "
                                 "its launch needs the side channel's host and port")
    args = ["--disaggregation-mode", KV_MODES[kv.role], "--disaggregation-transfer-backend", KV_BACKENDS[kv.connector]]
    if kv.role == "prefill":
        args += ["--disaggregation-bootstrap-port", str(ctx.kv_side_channel[1])]
    return args


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


ADAPTER = SGLangAdapter()
