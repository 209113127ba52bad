"""The catalog: models, engine profiles and how many replicas of each pair.

The catalog is configuration (``server.yaml``), never dynamic state.  These
dataclasses are what the rest of the runtime consumes once the file has passed
its schema; ``Catalog.from_config`` is the only place that turns the raw
mapping into them, so validation rules live in one place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class SourceKind(str, Enum):
    PATH = "path"  # absolute or explicitly relative (./, ../): must exist
    URL = "url"  # http(s)://: fetched before launch
    HUB = "hub"  # bare hub id (Qwen/Qwen2.5-7B-Instruct): passed to the engine untouched


def source_kind(source: str) -> SourceKind:
    """Classify a model source.

    Only an absolute or *explicitly* relative path is a path: a bare
    ``org/name`` is a hub id that vLLM and SGLang resolve themselves, and
    treating it as a relative path would make every hub profile fail.
    """
    if source.startswith(("https://", "http://")):
        return SourceKind.URL
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
class Deployment:
    """``replicas`` copies of ``model`` served with ``profile``."""

    model: str
    profile: str
    replicas: int

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
        models = {}
        for m in cfg.get("models", ()):
            models[m["name"]] = Model(
                name=m["name"],
                source=m["source"],
                served_name=m.get("served_name", m["name"]),
                size_bytes=m.get("size_bytes"),
                sha256=m.get("sha256"),
                max_model_len=m.get("max_model_len"),
            )
        profiles = {}
        for p in cfg.get("profiles", ()):
            profiles[p["name"]] = Profile(
                name=p["name"],
                engine=p["engine"],
                tensor_parallel_size=p.get("tensor_parallel_size", 1),
                pipeline_parallel_size=p.get("pipeline_parallel_size", 1),
                nodes=p.get("nodes", 1),
                extra_args=tuple(p.get("extra_args", ())),
                env=tuple(sorted(p.get("env", {}).items())),
                start_timeout=float(p.get("start_timeout", 900)),
                max_concurrency=p.get("max_concurrency"),
            )
        deployments = tuple(
            Deployment(model=d["model"], profile=d["profile"], replicas=d["replicas"])
            for d in cfg.get("deployments", ())
        )
        return cls(models=models, profiles=profiles, deployments=deployments)
