"""Scale from zero: which deployments may stop their last replica, by the name clients send.

A deployment with ``autoscale.min: 0`` (routers' signal only: an engine signal
has nothing to read with no engine running) goes to zero replicas after a
whole stable window with nothing in flight.  Its served name is published
with the endpoint set (``from_zero``) so that a router holds a request for
it, rather than answer that the model does not exist, and asks for a wake
(``router/holdqueue.py``); the wake's held count is the deployment's demand
(``autoscaler.Autoscaler.note_held``), which starts a replica.  A sleeping
deployment that lends its GPUs (``autoscale_lend``) is at zero while they
are lent, and comes back the same way.
"""

from __future__ import annotations

from llmgw.catalog import Catalog, Deployment

_names: tuple[Catalog | None, tuple[str, ...]] = (None, ())  # the last catalog asked about, and its answer


def can_reach_zero(d: Deployment) -> bool:
    """``min: 0``, or a sleeping deployment that lends its GPUs (``autoscale_lend``): at zero when lent."""
    a = d.autoscale
    return a is not None and (a.min == 0 or (a.sleep is not None and a.sleep.lend))


def from_zero_keys(catalog: Catalog, model: str) -> list[str]:
    """The deployments serving ``model`` (a served name) that can be at zero replicas."""
    return [d.key for d in catalog.deployments
            if can_reach_zero(d) and (m := catalog.models.get(d.model)) is not None and m.served_name == model]


def from_zero_names(catalog: Catalog) -> tuple[str, ...]:
    """Served names of the deployments that scale from zero, sorted; worked out once per catalog (every
    pass publishes them, and a catalog changes only on a reload)."""
    global _names
    if _names[0] is not catalog:
        names = {m.served_name for d in catalog.deployments
                 if can_reach_zero(d) and (m := catalog.models.get(d.model)) is not None}
        _names = (catalog, tuple(sorted(names)))
    return _names[1]
