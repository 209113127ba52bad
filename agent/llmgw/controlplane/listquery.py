"""The query of a list read (``GET /v1/nodes?state=ready&limit=500&after=gpu-0412``), parsed and checked.

At 10,000 nodes the whole of ``/v1/nodes`` is about 43 MB (and
``/v1/replicas`` as much at 40,000 shards), built and encoded in one go on
the event loop that also answers the agents' heartbeats.  A client that
needs every element (the inventory plugin) reads it in pages instead, each
a bounded stretch of the loop's time; one that needs some of them asks for
those states only.  Without a query the answer is the whole list, in the
order it always had.

Pages are keyed by id (a paged list is sorted by it), not numbered: an
element that comes or goes between two pages moves no other across a page
boundary, so a paged read never sees one twice or skips one that was there
throughout.

A parameter this parser does not know is refused, never ignored: a typo
(``?states=lost``) would otherwise answer the whole fleet as if filtered.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice

from llmgw.controlplane.lifecycle import NodeState
from llmgw.controlplane.replicas import ReplicaState

MAX_LIMIT = 10_000
NODE_STATES = tuple(s.value for s in NodeState)
REPLICA_STATES = tuple(s.value for s in ReplicaState)
PARAMETERS = ("state", "limit", "after")


class QueryError(ValueError):
    """A query the API answers with 400 and this message."""


@dataclass(frozen=True)
class ListQuery:
    """Which elements of a list a read asks for: all of them when nothing is set."""

    states: frozenset[str] | None = None  # None: every state
    limit: int | None = None  # None: no page limit
    after: str | None = None  # the page starts after this id (which need not exist)

    @property
    def paged(self) -> bool:
        return self.limit is not None or self.after is not None


def _single(params: Mapping[str, Sequence[str]], name: str) -> str | None:
    values = params.get(name, ())
    if len(values) > 1:
        raise QueryError(f"{name} is given {len(values)} times; give it once")
    return values[0] if values else None


def parse_list_query(params: Mapping[str, Sequence[str]], path: str, states: Sequence[str]) -> ListQuery:
    """``params``: each query parameter's values, in order; ``states``: those ``state=`` may name."""
    unknown = sorted(set(params) - set(PARAMETERS))
    if unknown:
        raise QueryError(f"unknown query parameter{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                         f"{path} takes {', '.join(PARAMETERS)}")
    wanted = None
    if "state" in params:
        asked = [s.strip() for v in params["state"] for s in v.split(",")]
        bad = [s for s in asked if s not in states]
        if bad or not asked:
            raise QueryError(f"state must be one or more of {', '.join(states)} (comma-separated or repeated), "
                             f"got {', '.join(repr(s) for s in bad)}")
        wanted = frozenset(asked)
    limit = _single(params, "limit")
    n = int(limit) if limit is not None and limit.isascii() and limit.isdigit() else None
    if limit is not None and (n is None or not 1 <= n <= MAX_LIMIT):
        raise QueryError(f"limit must be a whole number from 1 to {MAX_LIMIT}, got {limit!r}")
    after = _single(params, "after")
    if after == "":
        raise QueryError("after must be an id (the `next` of the previous page), got an empty value")
    return ListQuery(states=wanted, limit=n, after=after)


def page(ids: Sequence[str], query: ListQuery, state_of: Callable[[str], str]) -> tuple[list[str], str | None]:
    """The ids of the page ``query`` asks for out of the sorted ``ids``, and the ``after`` of the next page.

    The next page's key is None when no element the query wants follows this page.
    """
    start = 0 if query.after is None else bisect_right(ids, query.after)
    picked: list[str] = []
    for key in islice(ids, start, None):
        if query.states is not None and state_of(key) not in query.states:
            continue
        if query.limit is not None and len(picked) == query.limit:
            return picked, picked[-1]
        picked.append(key)
    return picked, None
