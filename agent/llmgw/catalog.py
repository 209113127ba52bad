"""The catalog: models, engine profiles and how many replicas of each pair.

The catalog is configuration (``server.yaml``), never dynamic state.  These
dataclasses are what the rest of the runtime consumes once the file has passed
its schema; ``Catalog.from_config`` is the only place that turns the raw
mapping into them, so validation rules live in one place.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from llmgw.repository import HUB_PREFIX, is_repository_url
from llmgw.schemadefaults import with_defaults


class SourceKind(str, Enum):
    PATH = "path"  # absolute or explicitly relative (./, ../): must exist
    URL = "url"  # http(s)://...file: fetched before launch
    REPO = "repo"  # http(s)://.../ (a directory with llmgw-manifest.json): every file fetched before launch
    HF = "hf"  # hf://ORG/NAME@REVISION: fetched before launch from the model's hub_endpoint
    HUB = "hub"  # bare hub id (Qwen/Qwen2.5-7B-Instruct): passed to the engine untouched


def source_kind(source: str) -> SourceKind:
    """Classify a model source.

    Only an absolute or *explicitly* relative path is a path: a bare
    ``org/name`` is a hub id that vLLM and SGLang resolve themselves, and
    treating it as a relative path would make every hub profile fail.
    """
    if source.startswith(("https://", "http://")):
        return SourceKind.REPO if is_repository_url(source) else SourceKind.URL
    if source.startswith(HUB_PREFIX):
        return SourceKind.HF
    if os.path.isabs(source) or source.startswith(("./", "../")) or source in (".", ".."):
        return SourceKind.PATH
    return SourceKind.HUB


@dataclass(frozen=True)
class Model:
    name: str
    source: str
    served_name: str  # what clients put in "model"; defaults to name
    size_bytes: int | None = None  # declared weights size, for the memory check
    sha256: str | None = None
    max_model_len: int | None = None
    hub_endpoint: str | None = None  # hf:// sources: the hub or mirror to fetch from (default huggingface.co)

    @property
    def kind(self) -> SourceKind:
        return source_kind(self.source)


# --- prefill/decode disaggregation ------------------------------------------
#
# A disaggregated deployment is declared once (``disaggregation`` on a
# deployment) and served as two groups of ordinary replicas: the catalog
# derives, for each role, a profile ``<profile>:<role>`` (the group's tensor
# parallel size, the connector and the role) and a deployment of it.  Every
# pass that places, starts, adopts or retires replicas then handles the groups
# as it handles any deployment; only the engine driver (the connector's flags)
# and the endpoint feed (the router's ``role``) read the role.  ``:`` is outside
# the names the schema accepts, so a derived profile never shadows a declared one,
# and inside what replica and shard ids may hold (the stream schema's ``id``).

ROLES = ("prefill", "decode")
ROLE_SEPARATOR = ":"


@dataclass(frozen=True)
class KVTransfer:
    """Which side of a KV-transfer pair a derived profile's replicas are."""

    connector: str  # "nixl"
    role: str  # "prefill" | "decode"

    def to_dict(self) -> dict[str, str]:
        return {"connector": self.connector, "role": self.role}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "KVTransfer":
        return cls(connector=str(d["connector"]), role=str(d["role"]))


@dataclass(frozen=True)
class RoleGroup:
    replicas: int
    tensor_parallel_size: int | None = None  # None: the profile's


@dataclass(frozen=True)
class Disaggregation:
    """The schema's ``disaggregation`` block of a deployment."""

    connector: str
    prefill: RoleGroup
    decode: RoleGroup

    def group(self, role: str) -> RoleGroup:
        return self.prefill if role == "prefill" else self.decode

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "Disaggregation":
        def group(g: Mapping[str, Any]) -> RoleGroup:
            return RoleGroup(replicas=int(g["replicas"]), tensor_parallel_size=g.get("tensor_parallel_size"))
        return cls(connector=d["connector"], prefill=group(d["prefill"]), decode=group(d["decode"]))


def role_profile_name(profile: str, role: str) -> str:
    return f"{profile}{ROLE_SEPARATOR}{role}"


def other_role(role: str) -> str:
    return "decode" if role == "prefill" else "prefill"


def peer_profile_name(profile: "Profile") -> str | None:
    """The profile of the other group of ``profile``'s pair; None for a profile that is not one side of a pair."""
    if profile.kv_transfer is None:
        return None
    declared = profile.name.rsplit(ROLE_SEPARATOR, 1)[0]
    return role_profile_name(declared, other_role(profile.kv_transfer.role))


def role_profile(p: "Profile", dis: Disaggregation, role: str) -> "Profile":
    """The profile one group of a disaggregated deployment runs: ``p`` with the group's TP and role."""
    tp = dis.group(role).tensor_parallel_size or p.tensor_parallel_size
    return replace(p, name=role_profile_name(p.name, role), tensor_parallel_size=tp,
                   kv_transfer=KVTransfer(connector=dis.connector, role=role))


@dataclass(frozen=True)
class Profile:
    name: str
    engine: str  # "vllm" | "sglang" | "llamacpp"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nodes: int = 1
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    start_timeout: float = 900.0
    max_concurrency: int | None = None  # per-endpoint limit the router enforces
    # The engine publishes its prefix cache's KV events on an endpoint the agent chooses (vLLM only).
    kv_events: bool = False
    # One side of a prefill/decode pair: set only on the profiles a disaggregated deployment derives.
    kv_transfer: KVTransfer | None = None

    @property
    def gpus_total(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def gpus_per_node(self) -> int:
        return self.gpus_total // self.nodes

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)


@dataclass(frozen=True)
class Sleep:
    """An autoscaled deployment's scale to sleep (the ``autoscale.sleep`` block): idle seconds, vLLM level."""

    after: float
    level: int = 1
    # A deployment asleep whole may be stopped to free its GPUs for another deployment that cannot be placed
    # (controlplane/autoscale_lend.py); it comes back from zero on its next request. False: held for it.
    lend: bool = False


@dataclass(frozen=True)
class Autoscale:
    """A deployment's demand-driven bounds and damping (the schema's ``autoscale`` block).

    The defaults here are the schema's (``tests/unit/test_autoscale_catalog.py``
    holds them equal); the rule that uses them is ``controlplane/autoscale.py``.
    """

    max: int
    min: int = 1
    signal: str = "outstanding"
    target: float = 8.0
    stable_window: float = 60.0
    panic_window: float = 6.0
    panic_threshold: float = 2.0
    tolerance: float = 0.1
    scale_down_cooldown: float = 300.0
    max_step: int = 4
    headroom: float = 0.0  # spare slots in standard deviations of the demand: target x count >= avg + h x sqrt(avg)
    max_scale_up_rate: float = 0.0  # a scale-up asks for at most this many times the Ready replicas (0: no cap)
    scale_down_stabilization: float = 0.0  # a scale-down no lower than the most wanted over these seconds (0: off)
    sleep: Sleep | None = None
    priority: int = 0  # who wins the fleet GPU budget (autoscale_budget): higher first

    def clamp(self, n: int) -> int:
        return max(self.min, min(self.max, n))

    @property
    def lends(self) -> bool:
        """Asleep whole, its GPUs may go to a deployment that waits for them (``sleep.lend``)."""
        return self.sleep is not None and self.sleep.lend

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "Autoscale":
        return cls(max=int(d["max"]), min=int(d["min"]), signal=d["signal"], target=float(d["target"]),
                   stable_window=float(d["stable_window"]), panic_window=float(d["panic_window"]),
                   panic_threshold=float(d["panic_threshold"]), tolerance=float(d["tolerance"]),
                   scale_down_cooldown=float(d["scale_down_cooldown"]), max_step=int(d["max_step"]),
                   headroom=float(d["headroom"]), max_scale_up_rate=float(d["max_scale_up_rate"]),
                   scale_down_stabilization=float(d["scale_down_stabilization"]),
                   sleep=(Sleep(after=float(d["sleep"]["after"]), level=int(d["sleep"]["level"]),
                                lend=bool(d["sleep"]["lend"]))
                          if d.get("sleep") is not None else None),
                   priority=int(d["priority"]))


@dataclass(frozen=True)
class Deployment:
    """``replicas`` copies of ``model`` served with ``profile``.

    With ``autoscale``, ``replicas`` is only where the count starts: the
    control plane's autoscaler decides the count the reconciler places.
    """

    model: str
    profile: str
    replicas: int
    autoscale: Autoscale | None = None
    # Set on the two deployments the catalog derives from a disaggregated one (``profile`` is then
    # the derived ``<declared>:<role>``); ``disaggregation`` keeps the declared block for views.
    role: str | None = None
    disaggregation: Disaggregation | None = None

    @property
    def key(self) -> str:
        return f"{self.model}/{self.profile}"


@dataclass(frozen=True)
class Catalog:
    models: dict[str, Model] = field(default_factory=dict)
    profiles: dict[str, Profile] = field(default_factory=dict)
    deployments: tuple[Deployment, ...] = ()
    # GPUs the autoscaled deployments share (server.yaml autoscale_budget.gpus); None: no arbitration
    autoscale_budget: int | None = None

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "Catalog":
        cfg = with_defaults(cfg, "server")  # a profile's defaults are the schema's
        models = {}
        for m in cfg.get("models", ()):
            models[m["name"]] = Model(
                name=m["name"],
                source=m["source"],
                served_name=m.get("served_name", m["name"]),
                size_bytes=m.get("size_bytes"),
                sha256=m.get("sha256"),
                max_model_len=m.get("max_model_len"),
                hub_endpoint=m.get("hub_endpoint"),
            )
        profiles = {}
        for p in cfg.get("profiles", ()):
            profiles[p["name"]] = Profile(
                name=p["name"],
                engine=p["engine"],
                tensor_parallel_size=p["tensor_parallel_size"],
                pipeline_parallel_size=p["pipeline_parallel_size"],
                nodes=p["nodes"],
                extra_args=tuple(p.get("extra_args", ())),
                env=tuple(sorted(p.get("env", {}).items())),
                start_timeout=float(p["start_timeout"]),
                max_concurrency=p.get("max_concurrency"),
                kv_events=p["kv_events"],
            )
        deployments: list[Deployment] = []
        for d in cfg.get("deployments", ()):
            if "disaggregation" in d:
                deployments += _role_deployments(d, profiles)
                continue
            deployments.append(
                Deployment(model=d["model"], profile=d["profile"], replicas=d["replicas"],
                           autoscale=Autoscale.from_config(d["autoscale"]) if "autoscale" in d else None))
        budget = cfg.get("autoscale_budget")
        return cls(models=models, profiles=profiles, deployments=tuple(deployments),
                   autoscale_budget=budget["gpus"] if budget is not None else None)

    def serving(self, served_name: str) -> list[Deployment]:
        """The deployments of the model clients call ``served_name``."""
        return [d for d in self.deployments
                if (m := self.models.get(d.model)) is not None and m.served_name == served_name]


def _role_deployments(d: Mapping[str, Any], profiles: dict[str, Profile]) -> list[Deployment]:
    """A disaggregated deployment's two groups, each a deployment of its derived profile (added to ``profiles``)."""
    dis = Disaggregation.from_config(d["disaggregation"])
    declared = profiles.get(d["profile"])
    out = []
    for role in ROLES:
        name = role_profile_name(d["profile"], role)
        if declared is not None:  # an unknown profile is the reference check's error, not a KeyError here
            profiles[name] = role_profile(declared, dis, role)
        out.append(Deployment(model=d["model"], profile=name, replicas=dis.group(role).replicas,
                              role=role, disaggregation=dis))
    return out


# --- which size counts -----------------------------------------------------
#
# Placement refuses a group whose memory cannot hold the weights plus
# headroom, and it can only do that when the size is known: declared in
# server.yaml (size_bytes), or learned from the weights themselves
# (``llmgw.weightprobe`` reads them; ``llmgw.controlplane.sizing`` keeps what
# the control plane learned).  Which of the two counts is decided here, with
# no I/O, so the pure reconciler and offline ``ctl explain`` share it.


def weights_bytes(model: Model, known_sizes: Mapping[str, int] | None = None) -> int | None:
    """The size placement checks memory against: the declared ``size_bytes``,
    else a size learned for the model's source (a local file's size, a remote
    file's Content-Length, the total an agent reported while fetching it).
    None when neither is known; placement then says memory was not checked."""
    if model.size_bytes is not None:
        return model.size_bytes
    if known_sizes:
        size = known_sizes.get(model.source)
        if size is not None and size > 0:
            return int(size)
    return None


SIZE_DECLARED = "declared"
SIZE_MEASURED = "measured from URL"
SIZE_UNKNOWN = "unknown"


def weights_size(model: Model, known_sizes: Mapping[str, int] | None = None,
                 origins: Mapping[str, str] | None = None) -> tuple[int | None, str]:
    """``weights_bytes`` and where that size came from: ``SIZE_DECLARED``, the
    origin recorded for the source in ``origins`` (``SIZE_MEASURED`` when none
    is), or ``SIZE_UNKNOWN``."""
    size = weights_bytes(model, known_sizes)
    if size is None:
        return None, SIZE_UNKNOWN
    if model.size_bytes is not None:
        return size, SIZE_DECLARED
    return size, (origins or {}).get(model.source, SIZE_MEASURED)
