"""The control plane's weight sizes: probed per catalog, learned from agents, kept while running.

A model with a declared ``size_bytes`` never needs one.  For a fetched source
(an http(s) file, a repository mirror, an hf:// repository) the control plane
asks the server (``llmgw.weightprobe.measure_sources``, the same probe
``llmgw ctl explain --probe-urls`` runs) once per catalog in force, at load and
at every reload, in a worker thread so the reconcile loop never waits on the
network; an agent downloading the source reports its total, which fills in
what the probe could not learn.  While an unknown source is being probed its
models are held from placement (``PROBE_HOLD`` at most), so they are not
placed without a memory check only because the answer was late.

``ControlPlane`` owns one ``WeightSizes`` and calls ``refresh`` on each pass
of its loop, ``learn_reported`` on each download progress report and
``cancel`` when its loop ends; the reconciler and the views read ``bytes``,
``holding``, ``probing``, ``warned`` and ``describe``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

from llmgw.catalog import SIZE_MEASURED, Catalog, Model, SourceKind, weights_size
from llmgw.weightprobe import measure_sources

log = logging.getLogger("llmgw.controlplane")

PROBE_TIMEOUT = 5.0  # seconds per request when sizing a URL (a HEAD, then maybe one ranged GET)
PROBE_HOLD = 30.0  # longest a model waits for its URL's size before it is placed without one


def reported_origin(node_id: str) -> str:
    return f"reported by agent {node_id} while downloading"


def unsized_sources(catalog: Catalog) -> dict[str, list[Model]]:
    """Fetched sources (files, repository mirrors, hf:// repositories) without a declared size, with the models that use them."""
    out: dict[str, list[Model]] = {}
    for m in catalog.models.values():
        if m.size_bytes is None and m.kind in (SourceKind.URL, SourceKind.REPO, SourceKind.HF):
            out.setdefault(m.source, []).append(m)
    return out


class WeightSizes:
    """Sizes of model sources learned while running, and where each came from.

    ``clock`` stamps when a probe started (for ``holding``); ``changed`` is
    called whenever a probe ends or an agent's report taught something, so
    the caller can run a pass with what is now known.
    """

    def __init__(self, clock: Callable[[], float], changed: Callable[[], None]) -> None:
        self.bytes: dict[str, int] = {}
        self.origin: dict[str, str] = {}
        self.probing: dict[str, float] = {}  # source -> when its probe started
        self.warned: dict[str, str] = {}  # source -> the failure last logged for it
        self.sized_for: object = None  # the catalog in force when the probes last started
        self._clock = clock
        self._changed = changed
        self._tasks: set[asyncio.Task[None]] = set()

    def learn(self, source: str, size: int, origin: str) -> bool:
        """Record a size; True when it is news."""
        if self.bytes.get(source) == size and self.origin.get(source) == origin:
            return False
        self.bytes[source], self.origin[source] = size, origin
        return True

    def holding(self, now: float) -> frozenset[str]:
        """Unknown sources still being probed, for at most ``PROBE_HOLD``."""
        return frozenset(src for src, t in self.probing.items()
                         if src not in self.bytes and now - t < PROBE_HOLD)

    def describe(self, model: Any) -> dict[str, Any]:
        size, origin = weights_size(model, self.bytes, self.origin)
        return {"bytes": size, "source": origin}

    # ----------------------------------------------------------------- probing
    def refresh(self, loaded: object, catalog: Catalog) -> None:
        """Probe the catalog's unsized URLs, once per ``loaded`` (the catalog in force), in the background.

        Called from the reconcile loop; returns at once.  A source already
        known keeps its size while it is probed again (a reload may point at
        a changed file); one not known holds its models' placement until the
        probe answers (``PROBE_HOLD`` at most).  Sizes of sources the catalog
        no longer fetches are forgotten.
        """
        if self.sized_for is loaded:
            return
        self.sized_for = loaded
        wanted = unsized_sources(catalog)
        for source in [s for s in self.bytes if s not in wanted]:
            self.bytes.pop(source, None)
            self.origin.pop(source, None)
        for source, models in wanted.items():
            if source in self.probing:
                continue
            self.probing[source] = self._clock()
            task = asyncio.get_running_loop().create_task(self._probe(source, models), name=f"size {source}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def cancel(self) -> None:
        """Stop the probes still running (the loop that started them is ending)."""
        for task in list(self._tasks):
            task.cancel()

    async def _probe(self, source: str, models: list[Model]) -> None:
        names = ", ".join(m.name for m in models)
        failures: dict[str, str] = {}
        loop = asyncio.get_running_loop()
        try:
            sizes = await loop.run_in_executor(None, functools.partial(
                measure_sources, models[:1], remote=True, timeout=PROBE_TIMEOUT, failures=failures))
        except Exception as e:  # never let a probe take anything else down
            sizes, failures = {}, {source: f"{type(e).__name__}: {e}"}
        finally:
            self.probing.pop(source, None)
        size = sizes.get(source)
        if size is not None:
            self.warned.pop(source, None)
            if self.learn(source, size, SIZE_MEASURED):
                log.info("model %s: weights at %s are %d bytes (%s)", names, source, size, SIZE_MEASURED)
        else:
            why = failures.get(source, "the server did not say")
            kept = self.bytes.get(source)
            tail = (f"keeping {kept} bytes ({self.origin.get(source)})" if kept is not None else
                    "placement cannot check GPU memory for it (declare size_bytes to make it)")
            level = logging.WARNING if self.warned.get(source) != why else logging.DEBUG
            self.warned[source] = why
            log.log(level, "model %s: cannot tell the size of %s: %s; %s", names, source, why, tail)
        self._changed()

    # ------------------------------------------------------- agents' reports
    def learn_reported(self, node_id: str, msg: dict[str, Any], catalog: Catalog) -> bool:
        """An agent downloading a URL knows its length: keep it when nothing better is known.

        True when the size was news (the caller then runs a pass with it).
        """
        source, total = msg.get("source"), msg.get("bytes_total")
        if not isinstance(total, int) or total <= 0 or source in self.bytes:
            return False
        names = [m.name for m in catalog.models.values() if m.source == source and m.size_bytes is None]
        if not names:
            return False
        self.learn(source, total, reported_origin(node_id))
        log.info("model %s: weights at %s are %d bytes (%s)", ", ".join(names), source, total,
                 reported_origin(node_id))
        return True
