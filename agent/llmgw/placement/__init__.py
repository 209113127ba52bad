"""Placement: which GPUs on which nodes a replica gets, or why none.

Pure functions over ``NodeCapacity`` and ``PlacementRequest``; nothing here
does I/O, so the reconciler and ``llmgw ctl explain`` reach the same answer
from the same inputs.
"""

from llmgw.placement.explain import format_result
from llmgw.placement.index import PlacementIndex
from llmgw.placement.multi import nccl_ib_hca
from llmgw.placement.place import place, place_many, profile_problem
from llmgw.placement.types import (
    NodeCapacity,
    NodeVerdict,
    Placement,
    PlacementRequest,
    PlacementResult,
    ShardPlan,
)

__all__ = [
    "NodeCapacity",
    "NodeVerdict",
    "Placement",
    "PlacementIndex",
    "PlacementRequest",
    "PlacementResult",
    "ShardPlan",
    "format_result",
    "nccl_ib_hca",
    "place",
    "place_many",
    "profile_problem",
]
