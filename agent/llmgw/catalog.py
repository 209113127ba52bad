"""The catalog: models, engine profiles and how many replicas of each pair.

The catalog is configuration (``server.yaml``), never dynamic state.  These
dataclasses are what the rest of the runtime consumes once the file has passed
its schema; ``Catalog.from_config`` is the only place that turns the raw
mapping into them, so validation rules live in one place.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from llmgw.repository import HUB_PREFIX, is_repository_url

log = logging.getLogger(__name__)


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
                hub_endpoint=m.get("hub_endpoint"),
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


# --- how big are the weights? ---------------------------------------------
#
# Placement refuses a group whose memory cannot hold the weights plus
# headroom, and it can only do that when the size is known: declared in
# server.yaml (size_bytes), or read from the weights themselves.

# Weight files in the order engines prefer them: a Hugging Face directory
# often ships both safetensors and .bin copies of the same tensors, and the
# engine loads only the safetensors, so only one group is ever counted.
WEIGHT_SUFFIX_GROUPS: tuple[tuple[str, ...], ...] = ((".safetensors",), (".bin", ".pt", ".pth"), (".gguf",))


def local_weights_bytes(path: str | os.PathLike[str]) -> int | None:
    """Size of the weights at a local path, or None when it cannot be told.

    A file counts whole.  A directory counts the files of the first suffix
    group that it has (``WEIGHT_SUFFIX_GROUPS``), searched recursively.
    Nothing there, or nothing readable, is None: unknown, never zero.
    """
    p = Path(path)
    try:
        if p.is_file():
            return p.stat().st_size
        if not p.is_dir():
            return None
        for suffixes in WEIGHT_SUFFIX_GROUPS:
            files = [f for f in p.rglob("*") if f.name.lower().endswith(suffixes) and f.is_file()]
            if files:
                return sum(f.stat().st_size for f in files)
    except OSError as e:
        log.debug("cannot size weights at %s: %s", p, e)
    return None


def probe_remote_size(url: str, timeout: float = 10.0) -> tuple[int | None, str | None]:
    """(size, None) for an http(s) weights file, or (None, why not).

    A HEAD (following redirects) that answers 200 with a Content-Length
    settles it.  Many object stores and CDNs refuse HEAD on a signed URL or
    leave the length out, so otherwise one GET asks for the first byte only
    (``Range: bytes=0-0``) and reads the total from ``Content-Range``
    (``bytes 0-0/TOTAL``); a server that ignores the range and answers 200 is
    read for its Content-Length, and its body is never read.
    """
    import httpx

    head_problem = None
    try:
        with httpx.Client(timeout=timeout, follow_redirects=True) as client:
            r = client.head(url)
            if r.status_code == 200:
                size = _positive(r.headers.get("content-length"))
                if size is not None:
                    return size, None
                head_problem = "HEAD gave no Content-Length"
            else:
                head_problem = f"HEAD answered {r.status_code}"
            with client.stream("GET", url, headers={"Range": "bytes=0-0", "Accept-Encoding": "identity"}) as g:
                if g.status_code == 206:
                    total = g.headers.get("content-range", "").rpartition("/")[2]
                    size = _positive(total)
                    if size is not None:
                        return size, None
                    return None, f"{head_problem}; GET bytes=0-0 gave no total in Content-Range"
                if g.status_code == 200 and "content-encoding" not in g.headers:
                    size = _positive(g.headers.get("content-length"))
                    if size is not None:
                        return size, None
                    return None, f"{head_problem}; GET gave no Content-Length"
                return None, f"{head_problem}; GET bytes=0-0 answered {g.status_code}"
    except httpx.HTTPError as e:
        why = f"{type(e).__name__}: {e}".rstrip(": ")
        log.debug("cannot size %s: %s", url, why)
        return None, f"{head_problem}; {why}" if head_problem else why


def probe_repository_size(url: str, timeout: float = 10.0, sha256: str | None = None) -> tuple[int | None, str | None]:
    """(total bytes of the files its manifest lists, None) for a repository mirror, or (None, why not).

    The manifest is read whole (it is small) and checked as the agent checks
    it, so a size is never taken from a manifest the agent would refuse.
    """
    import httpx

    from llmgw.repository import ManifestInvalid, manifest_url, parse_manifest

    where = manifest_url(url)
    try:
        with httpx.Client(timeout=timeout, follow_redirects=True) as client:
            r = client.get(where)
            if r.status_code != 200:
                return None, f"GET {where} answered {r.status_code}"
            data = r.content
    except httpx.HTTPError as e:
        return None, f"GET {where}: {type(e).__name__}: {e}".rstrip(": ")
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        return None, f"{where} has sha256 {hashlib.sha256(data).hexdigest()}, not the declared {sha256}"
    try:
        return parse_manifest(data, where).total_bytes, None
    except ManifestInvalid as e:
        return None, str(e)


def probe_hub_size(source: str, endpoint: str | None, timeout: float = 10.0) -> tuple[int | None, str | None]:
    """(total bytes of an hf:// repository's files at its revision, None), or (None, why not).

    Asked of the same endpoint the agents fetch from, through the same
    library, so the size is that of exactly what they will download.
    """
    from llmgw.repository import DEFAULT_HUB_ENDPOINT, parse_hub_source

    try:
        hub = parse_hub_source(source)
        from huggingface_hub import HfApi
        from huggingface_hub.hf_api import RepoFile
    except (ValueError, ImportError) as e:
        return None, str(e)
    try:
        api = HfApi(endpoint=endpoint or DEFAULT_HUB_ENDPOINT)
        files = api.list_repo_tree(hub.repo_id, recursive=True, revision=hub.revision)
        return sum(f.size for f in files if isinstance(f, RepoFile)), None
    except Exception as e:  # the library's errors name the URL and the status
        return None, f"{type(e).__name__}: {e}".rstrip(": ")


def _positive(value: str | None) -> int | None:
    try:
        n = int(value or "")
    except ValueError:
        return None
    return n if n > 0 else None


def remote_weights_bytes(url: str, timeout: float = 10.0) -> int | None:
    """Size of an http(s) weights file (``probe_remote_size``), or None when
    the server does not say or cannot be reached."""
    return probe_remote_size(url, timeout)[0]


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


def measure_sources(models: Mapping[str, Model] | list[Model], *, remote: bool = False,
                    timeout: float = 10.0, failures: dict[str, str] | None = None) -> dict[str, int]:
    """Sizes of the models' sources that can be read from here: local paths
    that exist on this machine, and (``remote=True``) http(s) files whose
    server tells their length (``probe_remote_size``) and repository mirrors
    (the sum of their manifest, ``probe_repository_size``) and hf://
    repositories (the sum of the hub's file list, ``probe_hub_size``).  Models with a declared
    size are skipped; hub ids are never sized (the engine resolves them).
    ``failures``, when given, receives why each remote source could not be sized."""
    items = models.values() if isinstance(models, Mapping) else models
    sizes: dict[str, int] = {}
    for m in items:
        if m.size_bytes is not None or m.source in sizes:
            continue
        size = None
        if m.kind is SourceKind.PATH:
            size = local_weights_bytes(m.source)
        elif m.kind in (SourceKind.URL, SourceKind.REPO, SourceKind.HF) and remote:
            if m.kind is SourceKind.HF:
                size, why = probe_hub_size(m.source, m.hub_endpoint, timeout)
            elif m.kind is SourceKind.REPO:
                size, why = probe_repository_size(m.source, timeout, m.sha256)
            else:
                size, why = probe_remote_size(m.source, timeout)
            if size is None and failures is not None:
                failures[m.source] = why or "unknown"
        if size is not None:
            sizes[m.source] = size
    return sizes
