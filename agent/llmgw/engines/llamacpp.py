"""llama.cpp: ``llama-server -m <file.gguf> --host H --port P --alias S -ngl 999``.

Flag names follow tools/server/README.md of ggml-org/llama.cpp (the table
``llama-gen-docs`` generates from the parser).  llama.cpp
loads one local GGUF file, so a hub id source is refused (``-hf`` downloads
are a second, unchecked distribution path), and a URL source must name a
``.gguf`` file, which the weight fetcher downloads before launch.

Every layer is offloaded (``-ngl 999``).  With tensor_parallel_size > 1 the
model is split layer-wise over the shard's GPUs in equal shares
(``--split-mode layer --tensor-split 1,1,...``), which is llama.cpp's default
and its most robust multi-GPU mode; CUDA_VISIBLE_DEVICES limits it to the
GPUs placement reserved.  There is no pipeline-parallel or multi-node mode
here: llama.cpp's ``--rpc`` backend is not something the agent can supervise.

llama.cpp also reads ``LLAMA_ARG_*`` environment variables for most flags, so
the env names of owned flags are refused in a profile's env as well.

The engine key goes in ``LLAMA_ARG_API_KEY`` (``--api-key``'s environment
variable in common/arg.cpp), never on the command line; ``--api-key`` and
``--api-key-file`` are owned.

TLS: ``--ssl-key-file``/``--ssl-cert-file`` (both owned, and their
``LLAMA_ARG_SSL_*`` variables) are parsed by every build but served only by a
llama-server built with OpenSSL (``LLAMA_OPENSSL``, on by default when the
OpenSSL headers are present, as in tests/engines/build-llama-server); one
built without refuses to start with "the server is built without SSL
support".  An operator with such a build leaves ``llamacpp`` out of
``engine_tls.engines`` in agent.yaml, and its endpoints stay ``http://``.
"""

from __future__ import annotations

from llmgw.catalog import Model, Profile, SourceKind, source_kind
from llmgw.engines.base import LaunchContext, LaunchContextError, Problem
from llmgw.engines.common import (
    USE_GPUS,
    USE_HOST,
    USE_KEY,
    USE_MAX_LEN,
    USE_PORT,
    USE_SERVED,
    USE_SOURCE,
    USE_TCP,
    USE_TLS,
    Adapter,
    FlagSyntax,
    OwnedFlag,
    url_path,
)

_USE_SPLIT = "set the profile field tensor_parallel_size instead (layers are split evenly over the shard's GPUs)"
_USE_NGL = "every layer is always offloaded to the shard's GPUs (-ngl 999)"
_USE_SINGLE = "llama.cpp shards run on one node"
_USE_ONE_MODEL = "each replica serves exactly its catalog model (declare other models in the catalog)"

_OWNED = (
    OwnedFlag(("-m", "--model"), USE_SOURCE),
    OwnedFlag(("-mu", "--model-url"), USE_SOURCE),
    OwnedFlag(("-hf", "-hfr", "--hf-repo"), USE_SOURCE),
    OwnedFlag(("-hff", "--hf-file"), USE_SOURCE),
    OwnedFlag(("-dr", "--docker-repo"), USE_SOURCE),
    # Router mode: llama-server serves (and loads on demand) other models than
    # the one the adapter names, under names the catalog does not know.
    OwnedFlag(("--models-dir",), _USE_ONE_MODEL),
    OwnedFlag(("--models-preset",), _USE_ONE_MODEL),
    OwnedFlag(("-a", "--alias"), USE_SERVED),
    OwnedFlag(("--host",), USE_HOST),
    OwnedFlag(("--port",), USE_PORT),
    OwnedFlag(("--api-prefix",), USE_TCP),
    OwnedFlag(("-ngl", "--gpu-layers", "--n-gpu-layers"), _USE_NGL),
    OwnedFlag(("-sm", "--split-mode"), _USE_SPLIT),
    OwnedFlag(("-ts", "--tensor-split"), _USE_SPLIT),
    OwnedFlag(("-dev", "--device"), USE_GPUS),
    OwnedFlag(("--rpc",), _USE_SINGLE),
    OwnedFlag(("--ssl-key-file",), USE_TLS),
    OwnedFlag(("--ssl-cert-file",), USE_TLS),
)

_FORBIDDEN_ENV = {
    "LLAMA_ARG_MODEL": USE_SOURCE,
    "LLAMA_ARG_MODEL_URL": USE_SOURCE,
    "LLAMA_ARG_HF_REPO": USE_SOURCE,
    "LLAMA_ARG_HF_FILE": USE_SOURCE,
    "LLAMA_ARG_DOCKER_REPO": USE_SOURCE,
    "LLAMA_ARG_MODELS_DIR": _USE_ONE_MODEL,
    "LLAMA_ARG_MODELS_PRESET": _USE_ONE_MODEL,
    "LLAMA_ARG_ALIAS": USE_SERVED,
    "LLAMA_ARG_HOST": USE_HOST,
    "LLAMA_ARG_PORT": USE_PORT,
    "LLAMA_ARG_API_PREFIX": USE_TCP,
    "LLAMA_ARG_N_GPU_LAYERS": _USE_NGL,
    "LLAMA_ARG_SPLIT_MODE": _USE_SPLIT,
    "LLAMA_ARG_TENSOR_SPLIT": _USE_SPLIT,
    "LLAMA_ARG_DEVICE": USE_GPUS,
    "LLAMA_ARG_RPC": _USE_SINGLE,
    "LLAMA_ARG_SSL_KEY_FILE": USE_TLS,
    "LLAMA_ARG_SSL_CERT_FILE": USE_TLS,
}


class LlamaCppAdapter(Adapter):
    name = "llamacpp"
    default_command = ("llama-server",)
    syntax = FlagSyntax()  # llama.cpp's own parser: exact spellings only
    forbidden_env = _FORBIDDEN_ENV
    key_flags = (OwnedFlag(("--api-key",), USE_KEY), OwnedFlag(("--api-key-file",), USE_KEY))
    key_env = "LLAMA_ARG_API_KEY"
    tls_capable = True

    def owned_flags(self, profile: Profile) -> tuple[OwnedFlag, ...]:
        return _OWNED

    def model_owned_flags(self, model: Model) -> tuple[OwnedFlag, ...]:
        if model.max_model_len is not None:
            return (OwnedFlag(("-c", "--ctx-size"), USE_MAX_LEN),)
        return ()

    def engine_problems(self, profile: Profile) -> list[str]:
        problems: list[str] = []
        if profile.nodes > 1:
            problems.append(Problem(
                f"nodes={profile.nodes}: llama.cpp serves a model from one node; "
                "use nodes: 1 (or vllm/sglang for multi-node)",
                "nodes",
            ))
        if profile.pipeline_parallel_size > 1:
            problems.append(Problem(
                f"pipeline_parallel_size={profile.pipeline_parallel_size}: llama.cpp has no "
                "pipeline parallelism here; use tensor_parallel_size to spread layers over GPUs",
                "pipeline_parallel_size",
            ))
        return problems

    def source_problems(self, model: Model) -> list[str]:
        kind = model.kind
        if kind is SourceKind.HUB:
            return [
                f"model {model.name!r}: source {model.source!r} is a hub id, but llama.cpp loads "
                "a local GGUF file; set source to a .gguf path or an https:// URL of one"
            ]
        path = url_path(model.source) if kind is SourceKind.URL else model.source
        if not path.lower().endswith(".gguf"):
            return [
                f"model {model.name!r}: source {model.source!r} is not a .gguf file, "
                "which is the only format llama.cpp loads"
            ]
        return []

    def engine_args(self, model: Model, profile: Profile, ctx: LaunchContext) -> list[str]:
        if source_kind(ctx.model_path) is not SourceKind.PATH:
            raise LaunchContextError(
                f"model_path {ctx.model_path!r} must be the local GGUF file for llama.cpp"
            )
        args = [
            "-m", ctx.model_path,
            "--host", ctx.host,
            "--port", str(ctx.port),
            "--alias", model.served_name,
            "-ngl", "999",
            # /metrics, which liveness reads for progress: without it every check
            # would be a completion queued behind the slots' own requests.
            "--metrics",
        ]
        if self.serves_tls(ctx):
            args += ["--ssl-key-file", str(ctx.tls_key), "--ssl-cert-file", str(ctx.tls_cert)]
        if model.max_model_len is not None:
            args += ["-c", str(model.max_model_len)]
        tp = profile.tensor_parallel_size
        if tp > 1:
            args += ["--split-mode", "layer", "--tensor-split", ",".join(["1"] * tp)]
        return args


ADAPTER = LlamaCppAdapter()
