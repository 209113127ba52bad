"""The catalog: models, engine profiles and how many replicas of each pair.

The catalog is configuration (``server.yaml``), never dynamic state.  These
dataclasses are what the rest of the runtime consumes once the file has passed
its schema; ``Catalog.from_config`` is the only place that turns the raw
mapping into them, so validation rules live in one place.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
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
    sleep: Sleep | None = None

    def clamp(self, n: int) -> int:
        return max(self.min, min(self.max, n))

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "Autoscale":
        return cls(max=int(d["max"]), min=int(d["min"]), signal=d["signal"], target=float(d["target"]),
                   stable_window=float(d["stable_window"]), panic_window=float(d["panic_window"]),
                   panic_threshold=float(d["panic_threshold"]), tolerance=float(d["tolerance"]),
                   scale_down_cooldown=float(d["scale_down_cooldown"]), max_step=int(d["max_step"]),
                   sleep=(Sleep(after=float(d["sleep"]["after"]), level=int(d["sleep"]["level"]))
                          if d.get("sleep") is not None else None))


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

    @property
    def key(self) -> str:
        return f"{self.model}/{self.profile}"


@dataclass(frozen=True)
class Catalog:
    models: dict[str, Model] = field(default_factory=dict)
    profiles: dict[str, Profile] = field(default_factory=dict)
    deployments: tuple[Deployment, ...] = ()

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
        deployments = tuple(
            Deployment(model=d["model"], profile=d["profile"], replicas=d["replicas"],
                       autoscale=Autoscale.from_config(d["autoscale"]) if "autoscale" in d else None)
            for d in cfg.get("deployments", ())
        )
        return cls(models=models, profiles=profiles, deployments=deployments)


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
