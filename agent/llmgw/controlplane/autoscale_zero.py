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

def can_reach_zero(d: Deployment) -> bool:
    """``min: 0``, or a sleeping deployment that lends its GPUs (``autoscale_lend``): at zero when lent."""
    a = d.autoscale
    return a is not None and (a.min == 0 or a.lends)


def from_zero_keys(catalog: Catalog, model: str) -> list[str]:
    """The deployments serving ``model`` (a served name) that can be at zero replicas."""
    return [d.key for d in catalog.serving(model) if can_reach_zero(d)]


def from_zero_names(catalog: Catalog) -> tuple[str, ...]:
    """Served names of the deployments that scale from zero, sorted (a walk over the deployments, as each
    pass makes for its autoscaled ones)."""
    return tuple(sorted({m.served_name for d in catalog.deployments
                         if can_reach_zero(d) and (m := catalog.models.get(d.model)) is not None}))
