"""What every engine adapter shares: owned flags, shape checks, env, sources.

An adapter turns (model, profile, launch context) into an exact argv and env.
Three things go wrong in practice and are checked here, before anything is
launched, because an engine that refuses its arguments does so minutes into a
load:

* a profile's ``extra_args`` sets a flag the adapter already sets (``--port``,
  ``-tp``...).  Both would reach the engine; argparse keeps the last one, so the
  replica would silently listen on a port nobody probes, or shard differently
  from what placement reserved.  Owned flags are refused, naming the profile
  field to use instead.
* a profile's env sets ``CUDA_VISIBLE_DEVICES``, which must come from the GPUs
  placement reserved for the shard.
* a model source that is a local path that does not exist.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence
from urllib.parse import urlparse

from llmgw.catalog import Model, Profile, SourceKind, source_kind
from llmgw.engines.base import (
    LaunchContext,
    LaunchContextError,
    LaunchSpec,
    Problem,
    ProfileError,
    SecretFile,
    SourceError,
    pointer_token,
)

# What to do instead of setting an owned flag, worded for the operator who
# wrote the profile in server.yaml.
USE_HOST = "the bind address comes from engine_bind_host in agent.yaml"
USE_PORT = "the port comes from engine_ports in agent.yaml"
USE_SOURCE = "set the model's source instead"
USE_SERVED = "set the model's served_name instead"
USE_TP = "set the profile field tensor_parallel_size instead"
USE_PP = "set the profile field pipeline_parallel_size instead"
USE_NODES = "set the profile field nodes instead"
USE_PLACEMENT = "placement sets it for each shard"
USE_REPLICAS = "scale with the deployment's replicas instead (each replica is its own engine)"
USE_MAX_LEN = "set the model's max_model_len instead"
USE_GPUS = "placement picks the shard's GPUs and the adapter sets CUDA_VISIBLE_DEVICES from them"
USE_ORDER = ("placement numbers GPUs as NVML does, in PCI bus order, and the adapter makes CUDA number them "
             "the same way (CUDA_DEVICE_ORDER=PCI_BUS_ID)")
USE_LISTED = "list the flags in extra_args instead, so they can be checked"
USE_TCP = "the router reaches every engine over TCP at the agent-assigned host:port"
USE_TLS = ("the agent serves TLS with the node's engine certificate (engine_tls in agent.yaml) and routers "
           "verify it against the fleet CA; routers present no client certificate")
USE_KEY = ("the control plane issues each replica its own engine key, which only the router and the agent's "
           "probe use")
# Reserved for what llmgw configures itself: KV event publishing (for cache-aware routing) binds an
# endpoint the agent must choose and see (an ipc:// path under the shard's state directory, never a
# tcp://* a hand-written config opens on every interface), and KV transfer pairs prefill and decode
# replicas whose roles and ports placement assigns.
USE_KV_EVENTS = ("reserved for llmgw, which configures the engine's KV event publisher itself "
                 "(on an endpoint the agent chooses)")
USE_KV_TRANSFER = ("reserved for llmgw, which configures KV transfer between replicas (prefill/decode "
                   "disaggregation) itself, from the roles and ports placement assigns")
USE_HTTP = "the router speaks OpenAI HTTP to rank 0 on the agent-assigned port"


@dataclass(frozen=True)
class OwnedFlag:
    """A flag the adapter sets itself, under every spelling the engine accepts."""

    spellings: tuple[str, ...]
    use_instead: str

    @property
    def name(self) -> str:
        longs = [s for s in self.spellings if s.startswith("--")]
        return longs[0] if longs else self.spellings[0]


@dataclass(frozen=True)
class FlagSyntax:
    """How an engine's command-line parser reads flags, so every form is caught.

    ``underscores``: vLLM's FlexibleArgumentParser turns ``--tensor_parallel_size``
    into ``--tensor-parallel-size`` before parsing.
    ``abbreviations``: Python's argparse (vLLM, SGLang) accepts any unambiguous
    prefix of a long flag, so ``--por 9000`` is ``--port 9000``.
    ``attached_short``: argparse reads ``-n2`` as ``-n 2`` for one-letter flags.
    ``dotted``: vLLM's FlexibleArgumentParser merges ``--kv-transfer-config.kv_role x``
    into ``--kv-transfer-config '{"kv_role": "x"}'``, so the flag is what precedes the dot.
    llama.cpp's own parser does none of these.
    """

    underscores: bool = False
    abbreviations: bool = False
    attached_short: bool = False
    dotted: bool = False


ARGPARSE = FlagSyntax(abbreviations=True, attached_short=True)


def _flag_name(token: str, syntax: FlagSyntax) -> str:
    name = token.split("=", 1)[0]
    if syntax.dotted and name.startswith("-"):
        name = name.split(".", 1)[0]
    if syntax.underscores and name.startswith("--"):
        key, dot, rest = name[2:].partition(".")
        name = "--" + key.replace("_", "-") + dot + rest
    return name


def _is_flag(token: str) -> bool:
    if not token.startswith("-") or token == "-" or token == "--":
        return False
    # "-1", "-0.5": a negative number is a value, as argparse treats it.
    try:
        float(token)
    except ValueError:
        return True
    return False


def find_owned(
    args: Sequence[object], owned: Iterable[OwnedFlag], syntax: FlagSyntax
) -> list[tuple[int, str, OwnedFlag]]:
    """Every token in ``args`` that sets an owned flag: its index, the token, the flag it sets.

    Non-string elements are skipped (``args_type_problems`` reports them);
    indices are those of ``args`` itself, so a config error can point at the
    offending element.
    """
    owned = tuple(owned)
    exact: dict[str, OwnedFlag] = {s: f for f in owned for s in f.spellings}
    longs = [(s, f) for f in owned for s in f.spellings if s.startswith("--")]
    shorts = [(s, f) for f in owned for s in f.spellings if len(s) == 2 and s[1] != "-"]
    hits: list[tuple[int, str, OwnedFlag]] = []
    for i, token in enumerate(args):
        if not isinstance(token, str) or not _is_flag(token):
            continue
        name = _flag_name(token, syntax)
        if name in exact:
            hits.append((i, token, exact[name]))
            continue
        if syntax.abbreviations and name.startswith("--") and len(name) > 3:
            flag = next((f for s, f in longs if s.startswith(name)), None)
            if flag is not None:
                hits.append((i, token, flag))
                continue
        if syntax.attached_short and not token.startswith("--"):
            flag = next((f for s, f in shorts if token.startswith(s) and len(token) > 2), None)
            if flag is not None:
                hits.append((i, token, flag))
    return hits


def owned_problems(
    engine: str, args: Sequence[object], owned: Iterable[OwnedFlag], syntax: FlagSyntax
) -> list[str]:
    problems: list[str] = []
    for i, token, flag in find_owned(args, owned, syntax):
        form = "" if token == flag.name else f" (as {token!r})"
        problems.append(Problem(
            f"extra_args sets {flag.name}{form}, which the {engine} adapter sets itself: "
            f"{flag.use_instead}",
            f"extra_args/{i}",
        ))
    return problems


@dataclass(frozen=True)
class MemoryFraction:
    """The share of each GPU's memory a profile lets its engine take, as its flags set it."""

    flag: str  # "--gpu-memory-utilization"
    value: float
    index: int  # of the flag in extra_args, for a config error's pointer


def find_memory_fraction(
    args: Sequence[object], flag: str, syntax: FlagSyntax, aliases: tuple[str, ...] = ()
) -> MemoryFraction | str | None:
    """The last setting of ``flag`` (or one of its ``aliases``) in ``args`` (argparse keeps the last), read
    under every spelling the engine accepts; the problem's text when its value is not a fraction in (0, 1];
    None when unset."""
    hits = find_owned(args, (OwnedFlag((flag, *aliases), ""),), syntax)
    if not hits:
        return None
    i, token, _ = hits[-1]
    if "=" in token:
        raw: object = token.split("=", 1)[1]
    elif i + 1 < len(args):
        raw = args[i + 1]
    else:
        return f"extra_args sets {flag} without a value"
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return f"extra_args sets {flag} to {raw!r}, not a number"
    if not 0 < value <= 1:
        return f"extra_args sets {flag} to {raw}, outside (0, 1]: it is a share of each GPU's memory"
    return MemoryFraction(flag, value, i)


def shape_problems(profile: Profile) -> list[str]:
    """Parallelism that no engine can run: non-positive sizes, uneven node split."""
    problems: list[str] = []
    for field_name in ("tensor_parallel_size", "pipeline_parallel_size", "nodes"):
        value = getattr(profile, field_name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(Problem(f"{field_name} must be a positive integer, got {value!r}", field_name))
    if not problems and profile.gpus_total % profile.nodes:
        problems.append(Problem(
            f"tensor_parallel_size x pipeline_parallel_size = {profile.gpus_total} GPUs "
            f"cannot be split evenly over nodes={profile.nodes}",
            "nodes",
        ))
    return problems


def env_problems(profile: Profile, forbidden: Mapping[str, str]) -> list[str]:
    """Profile env keys the adapter owns; ``forbidden`` maps key -> what to use instead."""
    problems: list[str] = []
    owned = {"CUDA_VISIBLE_DEVICES": USE_GPUS, "CUDA_DEVICE_ORDER": USE_ORDER, **forbidden}
    for key, _ in profile.env:
        if key in owned:
            problems.append(Problem(
                f"env sets {key}, which the adapter sets itself: {owned[key]}",
                f"env/{pointer_token(key)}",
            ))
    return problems


def args_type_problems(profile: Profile) -> list[str]:
    return [
        Problem(f"extra_args[{i}] must be a string, got {type(a).__name__}", f"extra_args/{i}")
        for i, a in enumerate(profile.extra_args)
        if not isinstance(a, str)
    ]


def raise_if(problems: list[str], subject: str, source_problems: Sequence[str] = ()) -> None:
    """Raise one error listing every problem (SourceError when a source is at fault)."""
    allp = list(problems) + list(source_problems)
    if not allp:
        return
    lines = "\n".join(f"  - {p}" for p in allp)
    noun = "problem" if len(allp) == 1 else "problems"
    cls = SourceError if source_problems else ProfileError
    raise cls(f"{subject}: {len(allp)} {noun}:\n{lines}", allp)


def check_context(profile: Profile, ctx: LaunchContext) -> None:
    """The launch context must describe one shard of exactly this profile."""
    problems = []
    if ctx.nnodes != profile.nodes:
        problems.append(f"nnodes={ctx.nnodes} but profile {profile.name!r} has nodes={profile.nodes}")
    if not 0 <= ctx.rank < max(ctx.nnodes, 1):
        problems.append(f"rank={ctx.rank} is outside 0..{ctx.nnodes - 1}")
    if ctx.nnodes > 1 and not ctx.master_addr:
        problems.append("master_addr is required when nnodes > 1")
    if ctx.gpu_indices:
        if len(ctx.gpu_indices) != profile.gpus_per_node:
            problems.append(
                f"gpu_indices={list(ctx.gpu_indices)} has {len(ctx.gpu_indices)} GPUs, "
                f"profile {profile.name!r} needs {profile.gpus_per_node} per node"
            )
        if len(set(ctx.gpu_indices)) != len(ctx.gpu_indices):
            problems.append(f"gpu_indices={list(ctx.gpu_indices)} repeats a GPU")
    if ctx.rank == 0 and not 0 < ctx.port < 65536:
        problems.append(f"port={ctx.port} is not a TCP port")
    for key in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        if key in ctx.extra_env:
            problems.append(f"extra_env sets {key}; it is derived from gpu_indices")
    if not ctx.model_path:
        problems.append("model_path is empty")
    if problems:
        raise LaunchContextError(
            "launch context does not fit profile "
            f"{profile.name!r}: " + "; ".join(problems)
        )


def build_env(profile: Profile, ctx: LaunchContext) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES from the shard's GPUs, then the profile's env, then placement's.

    A profile key that placement also sets with a different value is an error:
    placement's value (NCCL_IB_HCA naming only ACTIVE adapters) is a checked
    fact, and silently overriding either side hides a misconfiguration.
    No GPU indices (a CPU-only or simulated shard) leaves CUDA_VISIBLE_DEVICES unset.
    """
    env: dict[str, str] = {}
    if ctx.gpu_indices:
        # The indices are NVML's, which follow PCI bus order; CUDA's default order is
        # fastest-first, which on a box of mixed cards names other GPUs by the same numbers.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in ctx.gpu_indices)
    prof = profile.env_dict
    clashes: list[str] = [
        Problem(f"env sets {k}={prof[k]!r} but placement sets {k}={v!r} for this shard",
                f"env/{pointer_token(k)}")
        for k, v in ctx.extra_env.items()
        if k in prof and prof[k] != v
    ]
    raise_if(clashes, f"profile {profile.name!r}")
    env.update(prof)
    env.update(ctx.extra_env)
    return env


def resolve_model_path(model: Model, model_dir: str | None = None) -> str:
    """Where the engine should load ``model`` from, checked.

    * hub id (``Qwen/Qwen2.5-7B-Instruct``): returned untouched; vLLM and SGLang
      resolve it themselves.
    * absolute path: must exist.
    * explicitly relative path (``./``, ``../``): resolved against ``model_dir``
      (the agent's weights directory) or, without one, the working directory,
      and must exist.  Returned absolute, so the engine's own working directory
      does not matter.
    * URL: the weight fetcher downloads it before launch; asking for its path
      here is a caller bug and raises SourceError.
    """
    kind = source_kind(model.source)
    if kind is SourceKind.HUB:
        return model.source
    if kind in (SourceKind.URL, SourceKind.REPO, SourceKind.HF):
        raise SourceError(
            f"model {model.name!r}: source {model.source!r} is a URL; "
            "the weight fetcher downloads it and passes the local file to the adapter"
        )
    if os.path.isabs(model.source):
        path = os.path.normpath(model.source)
        where = ""
    else:
        base = model_dir or os.getcwd()
        path = os.path.normpath(os.path.join(base, model.source))
        where = f" (source {model.source!r} resolved against {base})"
    if not os.path.exists(path):
        raise SourceError(f"model {model.name!r}: model path {path} does not exist{where}")
    return path


def url_path(source: str) -> str:
    return urlparse(source).path


class Adapter:
    """One engine's argv/env construction and profile validation.

    Subclasses provide the engine's default command, owned flags and argv; the
    checks and the LaunchSpec assembly are shared so every engine refuses the
    same kinds of mistakes the same way.
    """

    name: str = ""
    default_command: tuple[str, ...] = ()
    syntax: FlagSyntax = FlagSyntax()
    forbidden_env: Mapping[str, str] = {}
    # How the engine is given its key: every spelling that sets it is owned,
    # and ``key_env`` (when the engine reads one) carries it, so it never
    # shows in ``ps``.  Adapters without a key variable override ``key_launch``.
    key_flags: tuple[OwnedFlag, ...] = ()
    key_env: str | None = None
    # The flag that caps the share of each GPU's memory the engine takes
    # (weights, activations and KV cache together); placement counts it.
    memory_fraction_flag: str | None = None
    memory_fraction_aliases: tuple[str, ...] = ()  # other names the engine accepts for it
    # Whether the pinned release can serve HTTPS (the adapter then emits its
    # certificate flags in ``engine_args`` when the context carries a pair).
    tls_capable: bool = False
    # Whether the adapter configures the engine's KV event publisher (a profile's ``kv_events``).
    kv_events_capable: bool = False
    # Whether the adapter configures one side of a prefill/decode KV-transfer pair
    # (a derived profile's ``kv_transfer``).
    kv_transfer_capable: bool = False
    # Whether the engine has a sleep mode the adapter can turn on (``LaunchContext.sleep_mode``;
    # a deployment's ``autoscale.sleep`` is refused for any other engine).
    sleep_capable: bool = False

    # -- what subclasses describe -------------------------------------------------
    def owned_flags(self, profile: Profile) -> tuple[OwnedFlag, ...]:
        raise NotImplementedError

    def model_owned_flags(self, model: Model) -> tuple[OwnedFlag, ...]:
        """Flags owned only because the model declares something (max_model_len)."""
        return ()

    def engine_problems(self, profile: Profile) -> list[str]:
        """Engine-specific limits (llama.cpp: single node, no pipeline parallelism)."""
        return []

    def source_problems(self, model: Model) -> list[str]:
        return []

    def engine_args(self, model: Model, profile: Profile, ctx: LaunchContext) -> list[str]:
        raise NotImplementedError

    def serves_http(self, ctx: LaunchContext) -> bool:
        return ctx.rank == 0

    def key_launch(self, ctx: LaunchContext) -> tuple[list[str], dict[str, str], tuple[SecretFile, ...]]:
        """(argv, env, files) that hand the engine its key; nothing for ranks serving no HTTP."""
        if not ctx.api_key or not self.serves_http(ctx):
            return [], {}, ()
        if self.key_env is None:
            raise LaunchContextError(f"the {self.name} adapter has no way to pass an engine key")
        return [], {self.key_env: ctx.api_key}, ()

    def serves_tls(self, ctx: LaunchContext) -> bool:
        """Whether this shard serves HTTPS: an engine that can, rank 0, and a certificate to serve."""
        return self.tls_capable and self.serves_http(ctx) and bool(ctx.tls_cert and ctx.tls_key)

    def key_env_owned(self) -> dict[str, str]:
        return {self.key_env: USE_KEY} if self.key_env else {}

    def owned_env(self) -> dict[str, str]:
        """Every variable the adapter owns, with why: refused in a profile's ``env``, and never inherited
        by the engine from the agent's own environment (a ``VLLM_SERVER_DEV_MODE=1`` in the agent's unit
        would otherwise open vLLM's unauthenticated dev routes on every engine it starts)."""
        return {**self.forbidden_env, **self.key_env_owned()}

    def launch_env(self, ctx: LaunchContext) -> dict[str, str]:
        """Variables the engine needs for what the adapter turned on in ``ctx`` (names in ``forbidden_env``)."""
        return {}

    def probe_fields(self, profile: Mapping[str, Any]) -> dict[str, Any]:
        """Fields the agent's one-token readiness completion carries for a shard of ``profile`` (the
        shard spec's form): what an engine needs to answer a request it would otherwise refuse."""
        return {}

    # -- shared -----------------------------------------------------------------
    def memory_fraction(self, profile: Profile) -> MemoryFraction | None:
        """The memory share ``profile``'s flags give the engine; None when they leave the engine's default."""
        if self.memory_fraction_flag is None:
            return None
        found = find_memory_fraction(profile.extra_args, self.memory_fraction_flag, self.syntax,
                                     self.memory_fraction_aliases)
        return found if isinstance(found, MemoryFraction) else None

    def profile_problems(self, profile: Profile) -> list[str]:
        problems: list[str] = []
        if profile.engine != self.name:
            problems.append(Problem(f"engine is {profile.engine!r}, not {self.name!r}", "engine"))
        shape = shape_problems(profile)
        problems += shape
        if not shape:
            problems += self.engine_problems(profile)
        if profile.kv_events and not self.kv_events_capable:
            problems.append(Problem(f"kv_events: the {self.name} adapter does not configure KV events; "
                                    "only vllm profiles can publish them", "kv_events"))
        if profile.kv_transfer is not None and not self.kv_transfer_capable:
            problems.append(Problem(f"disaggregation: the {self.name} driver cannot serve one side of a "
                                    "prefill/decode pair; only vllm profiles can", "kv_transfer"))
        problems += args_type_problems(profile)
        problems += owned_problems(self.name, profile.extra_args, self.owned_flags(profile) + self.key_flags,
                                   self.syntax)
        problems += env_problems(profile, self.owned_env())
        if self.memory_fraction_flag is not None:
            spellings = (self.memory_fraction_flag, *self.memory_fraction_aliases)
            found = find_memory_fraction(profile.extra_args, self.memory_fraction_flag, self.syntax,
                                         self.memory_fraction_aliases)
            if isinstance(found, str):
                hit = find_owned(profile.extra_args, (OwnedFlag(spellings, ""),), self.syntax)
                problems.append(Problem(found, f"extra_args/{hit[-1][0]}"))
        return problems

    def validate_profile(self, profile: Profile) -> None:
        """Raise ProfileError listing every problem with ``profile`` for this engine."""
        raise_if(self.profile_problems(profile), f"profile {profile.name!r} (engine {self.name})")

    def validate(self, model: Model, profile: Profile) -> None:
        """Profile checks plus those that need the model (sources, model-owned flags)."""
        problems = self.profile_problems(profile)
        problems += owned_problems(self.name, profile.extra_args, self.model_owned_flags(model), self.syntax)
        raise_if(
            problems,
            f"profile {profile.name!r} (engine {self.name}) for model {model.name!r}",
            self.source_problems(model),
        )

    def command(self, ctx: LaunchContext) -> tuple[str, ...]:
        return tuple(ctx.command) if ctx.command else self.default_command

    def build(self, model: Model, profile: Profile, ctx: LaunchContext) -> LaunchSpec:
        """The exact process for one shard; ``ctx.model_path`` is taken as resolved."""
        self.validate(model, profile)
        check_context(profile, ctx)
        key_args, key_env, files = self.key_launch(ctx)
        argv = (*self.command(ctx), *self.engine_args(model, profile, ctx), *key_args, *profile.extra_args)
        serves = self.serves_http(ctx)
        return LaunchSpec(
            argv=tuple(argv),
            env={**build_env(profile, ctx), **self.launch_env(ctx), **key_env},
            serves_http=serves,
            port=ctx.port if serves else None,
            files=files,
            tls=self.serves_tls(ctx),
            owned_env=frozenset(self.owned_env()),
        )
