"""Weights before launch: fetch a model source into the model directory.

The supervisor calls ``fetch_weights`` for a shard whose model source is the
URL of a file, ``fetch_repository`` for a repository (a mirror directory
URL, or ``hf://``), after reporting the shard ``fetching``, and launches the
engine on the path it returns; a ``FetchError`` (or any exception) fails the
shard with its message as the reason.  Paths and bare hub ids never come
here: a path that exists is used as it is, and a hub id goes to the engine
untouched.

The package is split by job, so that the decisions are testable without a
server and the I/O is small enough to read in one sitting:

=============  ==============================================================
``naming``     final and scratch file names (pure)
``resume``     what may be kept on disk; what a response allows (pure)
``progress``   rate and the ``progress`` message (pure)
``flight``     single flight per source; watchers and their progress
``scratch``    claiming a dead fetcher's partial file by atomic rename
``lock``       advisory lock to save bandwidth, never trusted for correctness
``durable``    fsync, rename, directory fsync, on-disk digest
``download``   one download from first GET to promotion
``repository`` a directory of files (manifest), staged then renamed whole
``hub``        an hf:// repository through huggingface_hub (``hubworker``)
=============  ==============================================================
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from llmgw.agent.fetch import download, hub, repository
from llmgw.agent.fetch.download import FetchError
from llmgw.agent.fetch.flight import Flight, FlightConflict, flights
from llmgw.agent.fetch.naming import SourceURLError, target_relpath
from llmgw.catalog import Model, SourceKind
from llmgw.settings import FetchPolicy

__all__ = ["OFFLINE_ENV", "FetchError", "FetchPolicy", "fetch_repository", "fetch_weights", "target_path"]

# An engine started on a fetched repository must not go to a hub behind the
# agent's back (for a missing file, a newer revision, a tokenizer): on an
# air-gapped node that hangs until start_timeout, elsewhere it loads weights
# nobody verified.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def target_path(source: str, model_dir: str | os.PathLike[str]) -> Path:
    """Where ``source`` is stored under ``model_dir`` (raises FetchError for a URL that names no file)."""
    try:
        return Path(os.path.abspath(model_dir)) / target_relpath(source)
    except SourceURLError as e:
        raise FetchError(str(e)) from e


async def fetch_weights(model: Model, model_dir: str | os.PathLike[str], *,
                        progress: Callable[[dict[str, Any]], None], shard_id: str,
                        node_id: str = "local", policy: FetchPolicy | None = None) -> str:
    """Local path of ``model.source`` once it is complete and verified; joins a download in flight.

    ``progress`` receives ``progress`` stream messages naming ``shard_id``
    (and any other shard of this process waiting on the same source).
    """
    final = target_path(model.source, model_dir)
    pol = policy or FetchPolicy()

    async def run(flight: Flight) -> str:
        return await download.run(download.Job(url=model.source, final=final, node_id=node_id,
                                               sha256=model.sha256, policy=pol, publish=flight.publish))

    try:
        return await flights().join((model.source, str(final)), final.name, model.sha256, shard_id, progress, run)
    except FlightConflict as e:
        raise FetchError(str(e)) from e


async def fetch_repository(model: Model, model_dir: str | os.PathLike[str], *,
                           progress: Callable[[dict[str, Any]], None], shard_id: str,
                           node_id: str = "local", policy: FetchPolicy | None = None) -> str:
    """Local directory of the repository ``model.source`` once every file is there and verified.

    A mirror directory URL (``model.sha256``, when declared, is its
    manifest's digest) or an ``hf://`` repository on ``model.hub_endpoint``.
    Shards of this process that want the same repository share one fetch,
    as for a file.
    """
    pol = policy or FetchPolicy()
    target = Path(os.path.abspath(model_dir))
    if model.kind is SourceKind.HF:
        root = hub.repo_root(model.source, model.hub_endpoint, model_dir)

        async def run(flight: Flight) -> str:
            return await hub.run(hub.Job(source=model.source, endpoint=model.hub_endpoint, model_dir=target,
                                         node_id=node_id, policy=pol, flight=flight))
        name = model.source
    else:
        root = repository.root_path(model.source, model_dir)

        async def run(flight: Flight) -> str:
            return await repository.run(repository.Job(source=model.source, model_dir=target, node_id=node_id,
                                                       sha256=model.sha256, policy=pol, flight=flight))
        name = repository.label(model.source)
    try:
        return await flights().join((model.source, str(root)), name, model.sha256, shard_id, progress, run)
    except FlightConflict as e:
        raise FetchError(str(e)) from e
