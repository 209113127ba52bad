"""How many replicas each deployment should have this pass: the declared count, or the autoscaler's.

The one place the reconciler reads a deployment's count from.  An
autoscaled deployment's count is ``Context.replica_counts`` (decided by
``controlplane/autoscale.py`` and, with a fleet GPU budget, granted by
``controlplane/autoscale_budget.py``: a deployment cut by a higher priority
gets its granted count here, so its surplus drains like any scale-down);
every other pass (slots, placement) then
works as for a declared count: new replicas are placed by the same
placement, and a surplus one is drained before it stops (``slots``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from llmgw.catalog import Catalog, Deployment


def deployments(catalog: Catalog, counts: Mapping[str, int]) -> tuple[Deployment, ...]:
    """The catalog's deployments, an autoscaled one's ``replicas`` replaced by its decided count."""
    return tuple(dataclasses.replace(d, replicas=counts[d.key])
                 if d.autoscale is not None and d.key in counts else d for d in catalog.deployments)
