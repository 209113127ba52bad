"""Command lines the simulator accepts, parsed the way the real engines parse them.

Three dialects, chosen by the first word so the adapters' argv reaches the
simulator unchanged (``ctx.command`` replaces only the engine binary):

* ``serve MODEL [flags]``: vLLM's ``vllm serve`` (v0.11.1+ flag names).  Like
  vLLM's FlexibleArgumentParser it accepts ``--flag_with_underscores``,
  ``--flag=value``, unambiguous abbreviations and ``--model M`` in place of the
  positional model, and rejects unknown flags with argparse's exit status 2.
* ``sglang [flags]``: ``python -m sglang.launch_server`` (server_args.py names).
* ``llama-server [flags]``: llama.cpp's server; unknown flags print
  ``error: invalid argument: X`` and exit 1, as llama.cpp's parser does.

Only a subset of each engine's flags is known: those the adapters emit plus the
ones operators commonly put in ``extra_args``.  Anything else is refused rather
than ignored, so a flag the real engine would reject never passes here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, NoReturn, Sequence

import yaml

from llmgw.sim.sim_interference import DEFAULT_CHUNK_TOKENS
from llmgw.sim.sim_kvcache import DEFAULT_BLOCK_SIZE

DIALECTS = ("serve", "sglang", "llama-server")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (``vllm/config/kv_events.py``), the fields the simulator uses."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000


@dataclass(frozen=True)
class DisaggregationConfig:
    """SGLang's ``--disaggregation-*`` flags (``srt/arg_groups/fields/disagg.py``) for a prefill or
    decode server; the simulator's side of the exchange is ``sim_disagg_sglang``."""

    mode: str  # "prefill" | "decode"
    transfer_backend: str = "mooncake"
    bootstrap_port: int = 8998  # the prefill's bootstrap server, on --host
    ib_device: str | None = None  # accepted; the simulator has no fabric to pick

    @property
    def prefill(self) -> bool:
        return self.mode == "prefill"


@dataclass(frozen=True)
class SimConfig:
    """What the simulator needs from an engine command line, dialect-neutral."""

    dialect: str  # "vllm" | "sglang" | "llamacpp"
    model: str
    served_names: tuple[str, ...]
    host: str | None  # None: every interface, as vLLM's default
    port: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_model_len: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    headless: bool = False  # a worker rank: no HTTP, stays alive
    api_keys: tuple[str, ...] = ()
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool = False  # vLLM's --enable-sleep-mode: /sleep and /wake_up work (sim_sleep)
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = 256
    enable_prompt_tokens_details: bool = False
    tool_call_parser: str | None = None  # vLLM: forced tool calls (named, "required") need one since 0.2x
    num_gpu_blocks: int | None = None  # --num-gpu-blocks-override; None: LLMGW_SIM_PREFIX_CACHE_BLOCKS
    kv_events: KVEventsConfig | None = None  # None: no KV events published
    kv_transfer: KVTransferConfig | None = None  # None: not one side of a disaggregated pair
    disaggregation: DisaggregationConfig | None = None  # SGLang's --disaggregation-*; None: mode null
    # PEM paths: serve HTTPS with them (vLLM's --ssl-keyfile/--ssl-certfile,
    # llama-server's --ssl-key-file/--ssl-cert-file); None: plain HTTP
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    # tokens of prompt prefilled per engine step (vLLM's --max-num-batched-tokens under chunked
    # prefill, SGLang's --chunked-prefill-size); None: a whole prompt in one step (sim_interference)
    prefill_chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS
    non_default: dict[str, Any] = field(default_factory=dict)

    @property
    def owned_by(self) -> str:
        return self.dialect


class ArgvError(Exception):
    """A command line the engine would refuse after parsing (exit status 1)."""


def human_readable_int(value: str) -> int:
    """vLLM's ``--max-model-len`` parser: ``32k`` = 32000, ``32K`` = 32768."""
    value = value.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if m:
        number, suffix = m.groups()
        if suffix.islower():
            return int(float(number) * {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}[suffix])
        try:
            return int(number) * {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[suffix]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"Decimals are not allowed with binary suffixes like {suffix}."
            ) from None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}") from None


def _non_default(parsed: dict[str, Any], defaults: dict[str, Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Arguments that differ from their defaults, for the start-up log; keys redacted."""
    out = {k: v for k, v in parsed.items() if v != defaults.get(k) and k not in skip}
    if "api_key" in out:
        out["api_key"] = "<redacted>"
    return out


# --------------------------------------------------------------------------- vLLM

# KVEventsConfig's fields and defaults in vLLM 0.33 (its pydantic config refuses any other key).
_KV_EVENTS_FIELDS: dict[str, tuple[type | tuple[type, ...], Any]] = {
    "enable_kv_cache_events": (bool, False),
    "publisher": ((str, type(None)), None),
    "endpoint": (str, "tcp://*:5557"),
    "replay_endpoint": ((str, type(None)), None),
    "buffer_steps": (int, 10_000),
    "hwm": (int, 100_000),
    "max_queue_size": (int, 100_000),
    "topic": (str, ""),
}


def _json_object(value: str) -> dict[str, Any]:
    """A flag's JSON object (vLLM's ``--*-config`` flags), or argparse's error."""
    try:
        doc = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return doc


def kv_events_json(value: str) -> dict[str, Any]:
    """``--kv-events-config``'s JSON, checked field by field as vLLM's config class checks it."""
    doc = _json_object(value)
    out = {k: default for k, (_, default) in _KV_EVENTS_FIELDS.items()}
    for key, v in doc.items():
        if key not in _KV_EVENTS_FIELDS:
            raise argparse.ArgumentTypeError(
                f"KVEventsConfig: unexpected field {key!r} (known: {', '.join(_KV_EVENTS_FIELDS)})")
        types = _KV_EVENTS_FIELDS[key][0]
        if isinstance(v, bool) is not (types is bool) or not isinstance(v, types):
            raise argparse.ArgumentTypeError(f"KVEventsConfig.{key}: wrong type {type(v).__name__}")
        out[key] = v
    if out["publisher"] is None:
        out["publisher"] = "zmq" if out["enable_kv_cache_events"] else "null"
    if out["publisher"] not in ("null", "zmq"):
        raise argparse.ArgumentTypeError(
            f"KVEventsConfig.publisher: {out['publisher']!r} is not one of 'null', 'zmq'")
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        if out[key] < 1:
            raise argparse.ArgumentTypeError(f"KVEventsConfig.{key}: must be >= 1, got {out[key]}")
    return out


ROLES = ("kv_producer", "kv_consumer", "kv_both")
POLICIES = ("recompute", "fail")
# KVTransferConfig's fields (vllm/config/kv_transfer.py): the simulator reads four, accepts the rest
_FIELDS = {"kv_connector", "engine_id", "kv_buffer_device", "kv_buffer_size", "kv_role", "kv_rank",
           "kv_parallel_size", "kv_ip", "kv_port", "kv_connector_extra_config", "kv_connector_module_path",
           "enable_permute_local_kv", "kv_load_failure_policy"}


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's ``--kv-transfer-config``, the fields the simulator uses."""

    connector: str
    role: str
    load_failure_policy: str = "fail"  # vLLM 0.32's default (vllm/config/kv_transfer.py)
    engine_id: str | None = None  # None: a fresh uuid per process, as vLLM's default

    @property
    def producer(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def consumer(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")


def kv_transfer_json(value: str) -> KVTransferConfig:
    """``--kv-transfer-config``'s JSON, refused as vLLM's config class refuses it."""
    doc = _json_object(value)
    unknown = sorted(set(doc) - _FIELDS)
    if unknown:
        raise argparse.ArgumentTypeError(f"KVTransferConfig: unexpected field {unknown[0]!r}")
    role = doc.get("kv_role")
    if doc.get("kv_connector") is not None and role not in ROLES:
        raise argparse.ArgumentTypeError(f"KVTransferConfig.kv_role: {role!r} is not one of {', '.join(ROLES)}")
    policy = doc.get("kv_load_failure_policy", KVTransferConfig.load_failure_policy)
    if policy not in POLICIES:
        raise argparse.ArgumentTypeError(
            f"KVTransferConfig.kv_load_failure_policy: {policy!r} is not one of {', '.join(POLICIES)}")
    connector = doc.get("kv_connector")
    if connector != "NixlConnector":
        raise argparse.ArgumentTypeError(
            f"KVTransferConfig.kv_connector: {connector!r}: the simulator models only NixlConnector")
    engine_id = doc.get("engine_id")
    if engine_id is not None and not (isinstance(engine_id, str) and engine_id):
        raise argparse.ArgumentTypeError("KVTransferConfig.engine_id: expected a non-empty string")
    return KVTransferConfig(connector, role, policy, engine_id)


def _ipc_endpoint(field_name: str, endpoint: str) -> None:
    """The simulator publishes only on ipc:// (a path on this host): a ``tcp://*`` endpoint would
    listen on every interface, and any other address is one vLLM would connect out to."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return
    if endpoint.startswith("tcp://") and ("*" in endpoint or "::" in endpoint):
        raise ArgvError(f"Invalid endpoint: kv_events_config.{field_name} {endpoint!r} binds every network "
                        "interface; publish KV events on an ipc:// endpoint")
    raise ArgvError(f"Invalid endpoint: kv_events_config.{field_name} {endpoint!r}: only ipc:// endpoints are "
                    "supported")


def kv_events_config(doc: dict[str, Any] | None, data_parallel_size: int) -> KVEventsConfig | None:
    if doc is None or not doc["enable_kv_cache_events"] or doc["publisher"] == "null":
        return None
    _ipc_endpoint("endpoint", doc["endpoint"])
    if doc["replay_endpoint"] is not None:
        _ipc_endpoint("replay_endpoint", doc["replay_endpoint"])
    if data_parallel_size > 1:  # vLLM's offset_endpoint_port for ranks above 0
        raise ArgvError("Invalid endpoint: must contain 'inproc' or 'tcp'")
    return KVEventsConfig(endpoint=doc["endpoint"], replay_endpoint=doc["replay_endpoint"], topic=doc["topic"],
                          buffer_steps=doc["buffer_steps"], hwm=doc["hwm"])


def _vllm_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, usage=f"{prog} [model_tag] [options]")
    bool_opt = argparse.BooleanOptionalAction
    p.add_argument("model_tag", nargs="?", help="The model tag to serve")
    p.add_argument("--headless", action="store_true", default=False)
    p.add_argument("--api-server-count", "-asc", type=int, default=None)
    # Frontend
    p.add_argument("--host", type=str, default=None)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", type=str, nargs="+", default=None)
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--disable-uvicorn-access-log", action=bool_opt, default=False)
    p.add_argument("--enable-prompt-tokens-details", action=bool_opt, default=False)
    p.add_argument("--chat-template", type=str, default=None)
    p.add_argument("--response-role", type=str, default="assistant")
    p.add_argument("--enable-auto-tool-choice", action=bool_opt, default=False)
    p.add_argument("--tool-call-parser", type=str, default=None)
    p.add_argument("--enable-log-requests", action=bool_opt, default=False)
    p.add_argument("--disable-log-requests", action="store_true", default=False)
    p.add_argument("--enable-force-include-usage", action=bool_opt, default=False)
    p.add_argument("--ssl-keyfile", type=str, default=None)
    p.add_argument("--ssl-certfile", type=str, default=None)
    p.add_argument("--ssl-ca-certs", type=str, default=None)
    p.add_argument("--enable-ssl-refresh", action=bool_opt, default=False)
    p.add_argument("--ssl-cert-reqs", type=int, default=0)
    # Model
    p.add_argument("--served-model-name", type=str, nargs="+", default=None)
    p.add_argument("--tokenizer", type=str, default=None)
    p.add_argument("--revision", type=str, default=None)
    p.add_argument("--trust-remote-code", action=bool_opt, default=False)
    p.add_argument("--dtype", default="auto",
                   choices=["auto", "bfloat16", "float", "float16", "float32", "half"])
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-model-len", type=human_readable_int, default=None)
    p.add_argument("--quantization", "-q", type=str, default=None)
    p.add_argument("--enforce-eager", action=bool_opt, default=False)
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--generation-config", type=str, default="auto")
    p.add_argument("--reasoning-parser", type=str, default="")
    # Load
    p.add_argument("--load-format", type=str, default="auto")
    p.add_argument("--download-dir", type=str, default=None)
    # Parallel
    p.add_argument("--distributed-executor-backend", default=None,
                   choices=["external_launcher", "mp", "ray", "uni"])
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--master-addr", type=str, default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29501)
    p.add_argument("--nnodes", "-n", type=int, default=1)
    p.add_argument("--node-rank", "-r", type=int, default=0)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    p.add_argument("--enable-expert-parallel", action=bool_opt, default=False)
    p.add_argument("--disable-custom-all-reduce", action=bool_opt, default=False)
    # Cache
    p.add_argument("--block-size", type=int, default=None, choices=[1, 8, 16, 32, 64, 128, 256])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--swap-space", type=float, default=4)
    p.add_argument("--kv-cache-dtype", type=str, default="auto")
    p.add_argument("--enable-prefix-caching", action=bool_opt, default=None)
    p.add_argument("--prefix-caching-hash-algo", type=str, default="sha256")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--kv-events-config", type=kv_events_json, default=None)
    p.add_argument("--kv-transfer-config", type=kv_transfer_json, default=None)
    p.add_argument("--cpu-offload-gb", type=float, default=0)
    p.add_argument("--enable-sleep-mode", action=bool_opt, default=False)
    # Scheduler
    p.add_argument("--max-num-batched-tokens", type=human_readable_int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--enable-chunked-prefill", action=bool_opt, default=None)
    p.add_argument("--async-scheduling", action=bool_opt, default=False)
    # Other
    p.add_argument("--disable-log-stats", action="store_true", default=False)
    p.add_argument("--compilation-config", "-O", type=str, default=None)
    return p


def _flexible(args: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """vLLM FlexibleArgumentParser's rewriting: ``--model M`` to the front, ``_`` to ``-``."""
    args = list(args)
    idx = next((i for i, a in enumerate(args) if re.match(r"^--model(=.+|$)", a)), None)
    if idx is not None:
        if args[idx] == "--model":
            if idx + 1 >= len(args) or args[idx + 1].startswith("-"):
                parser.error("argument --model: expected one argument")
            tag, rest = args[idx + 1], idx + 2
        else:
            tag, rest = args[idx].removeprefix("--model="), idx + 1
        args = [tag, *args[:idx], *args[rest:]]
    out = []
    for a in args:
        if a.startswith("--"):
            key, eq, value = a.partition("=")
            head, dot, tail = key[2:].partition(".")
            out.append("--" + head.replace("_", "-") + dot + tail + eq + value)
        else:
            out.append(a)
    return out


def parse_vllm(args: Sequence[str], prog: str = "vllm serve") -> SimConfig:
    parser = _vllm_parser(prog)
    ns = parser.parse_args(_flexible(args, parser))
    if ns.model_tag is None:
        parser.error("the model to serve is required: vllm serve <model> [options]")
    defaults = vars(parser.parse_args([ns.model_tag]))
    non_default = _non_default(vars(ns), defaults, skip=("model_tag",))
    if not 0 <= ns.node_rank < ns.nnodes:
        raise ArgvError(f"node_rank ({ns.node_rank}) must be in [0, nnodes={ns.nnodes})")
    if ns.nnodes > 1 and ns.distributed_executor_backend not in (None, "mp", "uni", "external_launcher"):
        raise ArgvError(
            "nnodes > 1 can only be set when distributed executor backend is mp, uni "
            "or external_launcher."
        )
    if ns.num_gpu_blocks_override is not None and ns.num_gpu_blocks_override < 2:
        raise ArgvError(f"num_gpu_blocks_override={ns.num_gpu_blocks_override}: the KV cache needs at least 2 "
                        "blocks (one is the null block)")
    if ns.max_num_batched_tokens is not None and ns.max_num_batched_tokens < 1:
        raise ArgvError(f"max_num_batched_tokens ({ns.max_num_batched_tokens}) must be at least 1")
    world = ns.tensor_parallel_size * ns.pipeline_parallel_size
    if world % ns.nnodes:
        raise ArgvError(f"world size {world} (tp x pp) is not divisible by nnodes={ns.nnodes}")
    # vLLM: ``args.api_key or [envs.VLLM_API_KEY]``, empty keys dropped
    keys = tuple(k for k in (ns.api_key or [os.environ.get("VLLM_API_KEY", "")]) if k)
    return SimConfig(
        dialect="vllm",
        model=ns.model_tag,
        served_names=tuple(ns.served_model_name or (ns.model_tag,)),
        host=ns.host,
        port=ns.port,
        tensor_parallel_size=ns.tensor_parallel_size,
        pipeline_parallel_size=ns.pipeline_parallel_size,
        max_model_len=ns.max_model_len,
        nnodes=ns.nnodes,
        node_rank=ns.node_rank,
        master_addr=ns.master_addr,
        master_port=ns.master_port,
        headless=ns.headless,
        api_keys=keys,
        enable_prefix_caching=ns.enable_prefix_caching is not False,
        enable_sleep_mode=bool(ns.enable_sleep_mode),
        block_size=ns.block_size or DEFAULT_BLOCK_SIZE,
        max_num_seqs=ns.max_num_seqs or 256,
        enable_prompt_tokens_details=ns.enable_prompt_tokens_details,
        tool_call_parser=ns.tool_call_parser or None,
        num_gpu_blocks=ns.num_gpu_blocks_override,
        kv_events=kv_events_config(ns.kv_events_config, ns.data_parallel_size),
        kv_transfer=ns.kv_transfer_config,
        ssl_keyfile=ns.ssl_keyfile,
        ssl_certfile=ns.ssl_certfile,
        prefill_chunk_tokens=(None if ns.enable_chunked_prefill is False
                              else ns.max_num_batched_tokens or DEFAULT_CHUNK_TOKENS),
        non_default=non_default,
    )


# --------------------------------------------------------------------------- SGLang

# SGLang 0.5.23's DISAGG_TRANSFER_BACKEND_CHOICES (srt/arg_groups/choices.py)
DISAGG_TRANSFER_BACKENDS = ["mooncake", "nixl", "ascend", "fake", "mori", "mooncake_tcp"]


def _sglang_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--model-path", "--model", type=str, required=True)
    p.add_argument("--tokenizer-path", type=str, default=None)
    p.add_argument("--host", type=str, default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--served-model-name", type=str, default=None)
    p.add_argument("--api-key", type=str, default=None)
    p.add_argument("--tensor-parallel-size", "--tp-size", dest="tp_size", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "--pp-size", dest="pp_size", type=int, default=1)
    p.add_argument("--data-parallel-size", "--dp-size", dest="dp_size", type=int, default=1)
    p.add_argument("--dist-init-addr", "--nccl-init-addr", type=str, default=None)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--dtype", type=str, default="auto",
                   choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--enable-cache-report", action="store_true")
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--quantization", type=str, default=None)
    p.add_argument("--kv-cache-dtype", type=str, default="auto")
    p.add_argument("--chat-template", type=str, default=None)
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--log-level", type=str, default="info")
    p.add_argument("--log-requests", action="store_true")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--attention-backend", type=str, default=None)
    # PD disaggregation (SGLang 0.5.23's Disagg namespace)
    p.add_argument("--disaggregation-mode", type=str, default="null", choices=["null", "prefill", "decode"])
    p.add_argument("--disaggregation-transfer-backend", type=str, default="mooncake",
                   choices=DISAGG_TRANSFER_BACKENDS)
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    p.add_argument("--disaggregation-ib-device", type=str, default=None)
    p.add_argument("--disaggregation-decode-enable-radix-cache", action="store_true")
    return p


def sglang_disaggregation(ns: argparse.Namespace) -> DisaggregationConfig | None:
    """The prefill or decode side SGLang's flags ask for; None in mode null (aggregated)."""
    if ns.disaggregation_mode == "null":
        return None
    if ns.disaggregation_mode == "prefill" and ns.disaggregation_transfer_backend == "fake":
        raise ArgvError("Prefill server does not support 'fake' as the transfer backend")
    return DisaggregationConfig(ns.disaggregation_mode, ns.disaggregation_transfer_backend,
                                ns.disaggregation_bootstrap_port, ns.disaggregation_ib_device)


def _sglang_config(args: Sequence[str]) -> list[str]:
    """SGLang's ``--config FILE``: the YAML's ``key: value`` pairs become ``--key value`` flags
    placed before the command line's own (which win), inside the process."""
    args = list(args)
    for i, tok in enumerate(args):
        if tok == "--config" and i + 1 < len(args):
            path, rest = args[i + 1], args[:i] + args[i + 2:]
        elif tok.startswith("--config="):
            path, rest = tok.split("=", 1)[1], args[:i] + args[i + 1:]
        else:
            continue
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
        if not isinstance(doc, dict):
            raise ArgvError(f"config file {path} must contain a mapping")
        flags: list[str] = []
        for key, value in doc.items():
            name = "--" + str(key).replace("_", "-")
            if value is True:
                flags.append(name)
            elif value not in (False, None):
                flags += [name, str(value)]
        return flags + rest
    return args


def parse_sglang(args: Sequence[str], prog: str = "sglang.launch_server") -> SimConfig:
    parser = _sglang_parser(prog)
    ns = parser.parse_args(_sglang_config(args))
    if not 0 <= ns.node_rank < ns.nnodes:
        raise ArgvError(f"node_rank {ns.node_rank} out of range for nnodes={ns.nnodes}")
    if ns.nnodes > 1 and not ns.dist_init_addr:
        raise ArgvError("--dist-init-addr is required when --nnodes > 1")
    master_addr = master_port = None
    if ns.dist_init_addr:
        host, sep, port = ns.dist_init_addr.rpartition(":")
        if not sep or not port.isdigit():
            raise ArgvError(f"--dist-init-addr {ns.dist_init_addr!r} is not host:port")
        master_addr, master_port = host.strip("[]"), int(port)
    defaults = vars(parser.parse_args(["--model-path", ns.model_path]))
    disaggregation = sglang_disaggregation(ns)
    # SGLang: "Radix cache is disabled for decode server" unless asked for
    radix = not ns.disable_radix_cache and (ns.disaggregation_mode != "decode"
                                           or ns.disaggregation_decode_enable_radix_cache)
    return SimConfig(
        dialect="sglang",
        model=ns.model_path,
        served_names=(ns.served_model_name or ns.model_path,),
        host=ns.host,
        port=ns.port,
        tensor_parallel_size=ns.tp_size,
        pipeline_parallel_size=ns.pp_size,
        max_model_len=ns.context_length,
        nnodes=ns.nnodes,
        node_rank=ns.node_rank,
        master_addr=master_addr,
        master_port=master_port,
        headless=ns.node_rank > 0,  # SGLang's other ranks serve no HTTP
        api_keys=(ns.api_key,) if ns.api_key else (),
        enable_prefix_caching=radix,
        block_size=ns.page_size or 16,
        max_num_seqs=ns.max_running_requests or 256,
        enable_prompt_tokens_details=ns.enable_cache_report,
        prefill_chunk_tokens=(None if ns.chunked_prefill_size == -1  # SGLang: -1 disables chunking
                              else ns.chunked_prefill_size or DEFAULT_CHUNK_TOKENS),
        disaggregation=disaggregation,
        non_default=_non_default(vars(ns), defaults),
    )


# --------------------------------------------------------------------------- llama.cpp

class _LlamaParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"error: {message}\n")
        raise SystemExit(1)


def _llama_parser(prog: str) -> argparse.ArgumentParser:
    p = _LlamaParser(prog=prog, allow_abbrev=False)
    p.add_argument("-m", "--model", type=str, default=None)
    p.add_argument("-a", "--alias", type=str, default=None)
    p.add_argument("--host", type=str, default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", type=str, default="auto")
    p.add_argument("-c", "--ctx-size", type=int, default=0)
    p.add_argument("-sm", "--split-mode", choices=["none", "layer", "row", "tensor"], default="layer")
    p.add_argument("-ts", "--tensor-split", type=str, default=None)
    p.add_argument("-mg", "--main-gpu", type=int, default=0)
    p.add_argument("-np", "--parallel", type=int, default=None)
    p.add_argument("-t", "--threads", type=int, default=-1)
    p.add_argument("-b", "--batch-size", type=int, default=2048)
    p.add_argument("-ub", "--ubatch-size", type=int, default=512)
    p.add_argument("-fa", "--flash-attn", choices=["on", "off", "auto"], default="auto")
    p.add_argument("-s", "--seed", type=int, default=-1)
    p.add_argument("--api-key", type=str, default=os.environ.get("LLAMA_ARG_API_KEY"))
    p.add_argument("--api-key-file", type=str, default=None)
    p.add_argument("--ssl-key-file", type=str, default=os.environ.get("LLAMA_ARG_SSL_KEY_FILE"))
    p.add_argument("--ssl-cert-file", type=str, default=os.environ.get("LLAMA_ARG_SSL_CERT_FILE"))
    p.add_argument("--embedding", "--embeddings", action="store_true")
    p.add_argument("--metrics", action="store_true")
    p.add_argument("--jinja", action="store_true")
    p.add_argument("--no-webui", action="store_true")
    p.add_argument("--cache-prompt", dest="cache_prompt", action="store_true", default=True)
    p.add_argument("--no-cache-prompt", dest="cache_prompt", action="store_false")
    p.add_argument("--cont-batching", action="store_true")
    return p


def parse_llamacpp(args: Sequence[str], prog: str = "llama-server") -> SimConfig:
    parser = _llama_parser(prog)
    ns, unknown = parser.parse_known_args(list(args))
    if unknown:
        parser.error(f"invalid argument: {unknown[0]}")
    if not ns.model:
        parser.error("a model is required (-m, --model FNAME)")
    split = [s for s in (ns.tensor_split or "").split(",") if s]
    keys = tuple(k for k in (ns.api_key or "").split(",") if k)
    if ns.api_key_file:  # one key per line, as llama-server reads it
        with open(ns.api_key_file) as f:
            keys += tuple(line.strip() for line in f if line.strip())
    defaults = vars(parser.parse_args(["-m", ns.model]))
    return SimConfig(
        dialect="llamacpp",
        model=ns.model,
        served_names=tuple(a for a in (ns.alias or ns.model).split(",") if a),
        host=ns.host,
        port=ns.port,
        tensor_parallel_size=max(len(split), 1),
        max_model_len=ns.ctx_size or None,
        api_keys=keys,
        enable_prefix_caching=ns.cache_prompt,
        max_num_seqs=ns.parallel or 4,
        # llama-server serves TLS only with both files (and only when built with OpenSSL)
        ssl_keyfile=ns.ssl_key_file if ns.ssl_key_file and ns.ssl_cert_file else None,
        ssl_certfile=ns.ssl_cert_file if ns.ssl_key_file and ns.ssl_cert_file else None,
        non_default=_non_default(vars(ns), defaults),
    )


def parse_argv(argv: Sequence[str], prog: str = "llmgw-engine-sim") -> SimConfig:
    """Parse ``[dialect, *args]``; argparse errors exit the process as the engine would."""
    if not argv or argv[0] not in DIALECTS:
        usage = f"usage: {prog} {{{','.join(DIALECTS)}}} ...\n"
        if not argv:
            problem = "the following arguments are required: subcommand"
        else:
            choices = ", ".join(repr(d) for d in DIALECTS)
            problem = f"argument subcommand: invalid choice: {argv[0]!r} (choose from {choices})"
        sys.stderr.write(f"{usage}{prog}: error: {problem}\n")
        raise SystemExit(2)
    dialect, rest = argv[0], argv[1:]
    if dialect == "serve":
        return parse_vllm(rest, prog=f"{prog} serve")
    if dialect == "sglang":
        return parse_sglang(rest, prog=f"{prog} sglang")
    return parse_llamacpp(rest, prog=f"{prog} llama-server")
