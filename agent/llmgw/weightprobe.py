"""How big are a model's weights: read from a local path, or asked over the network.

Placement checks GPU memory against the size of the weights, and a model that
declares no ``size_bytes`` can only be checked once that size is read from
the weights themselves: a local file or directory, an http(s) file's length,
a repository mirror's manifest, an hf:// revision's file list on the hub.
Those reads are I/O (and the last three need the network), so they live here,
apart from the catalog's data model; offline ``llmgw ctl explain`` calls
``measure_sources`` directly, the control plane through
``llmgw.controlplane.sizing``, off its reconcile loop.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from llmgw.catalog import Model, SourceKind

log = logging.getLogger("llmgw.catalog")  # the name these messages have always had, for log filters


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
