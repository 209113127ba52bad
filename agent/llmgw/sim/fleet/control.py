"""Run-time commands: what an operator or a benchmark types to a running fleet (pure).

One command per line, answered by one line of JSON:

    stats                      the status document (as in --status-file)
    nodes                      one row per node: connection, registrations, faults, shards
    silence SHARE              SHARE of the nodes stop heartbeating; connections stay open
    kill SHARE [RESTART_AFTER] SHARE of the agents die (engines survive); restarted after
                               RESTART_AFTER seconds, or at the next heal
    restart SHARE              SHARE of the agents restart now (a new agent adopts the engines)
    flap SHARE [PERIOD]        SHARE of the agents die and come back every ~PERIOD s (default 10)
    slow SECONDS [SHARE]       SHARE (default all) register SECONDS after their WebSocket is up
    malformed SHARE            SHARE send one message that breaks the stream schema
    oversized SHARE            SHARE send one message over the control plane's size limit
    heal                       end every fault: unsilence, restart the killed, stop flapping
    go                         the agents held by --hold make their first dial now
    help                       this text
    quit                       stop the simulator

SHARE is a fraction (``0.05``), a percentage (``5%``), a node count (``n=12``)
or a list of node ids (``ids=sim-00003,sim-00017``: a rack, the nodes of one
replica).  Fractions and counts are drawn at random (seeded by ``--seed``)
from the whole fleet; the reply lists the node ids a command applied to.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Sequence

USAGE = __doc__.split("\n\n", 2)[1]

SHARE_OPS = ("silence", "kill", "restart", "flap", "malformed", "oversized")
PLAIN_OPS = ("stats", "nodes", "heal", "go", "help", "quit")


class CommandError(ValueError):
    pass


@dataclass(frozen=True)
class Command:
    op: str
    share: str | None = None  # as typed; resolved against the fleet size by ``count``
    arg: float | None = None


def parse_share(text: str) -> tuple[str, Any]:
    """("fraction", f), ("count", n) or ("ids", [node id, ...]); CommandError when it is none of them."""
    t = text.strip()
    if t.startswith("ids="):
        ids = [i for i in t[4:].split(",") if i]
        if not ids:
            raise CommandError(f"share {text!r}: ids= needs at least one node id")
        return "ids", ids
    try:
        if t.startswith("n="):
            n = int(t[2:])
            if n < 0:
                raise ValueError
            return "count", n
        f = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise CommandError(f"share {text!r}: expected a fraction (0.05), a percentage (5%), a count (n=12) "
                           "or node ids (ids=a,b)") from None
    if not 0.0 <= f <= 1.0:
        raise CommandError(f"share {text!r}: must be between 0 and 1 (0% and 100%)")
    return "fraction", f


def select(rng: random.Random, node_ids: Sequence[str], share: str) -> list[int]:
    """Node numbers a share applies to: the ids named, or drawn from the whole fleet."""
    kind, value = parse_share(share)
    total = len(node_ids)
    if kind == "ids":
        index = {n: i for i, n in enumerate(node_ids)}
        unknown = [n for n in value if n not in index]
        if unknown:
            raise CommandError(f"unknown node id(s): {', '.join(unknown[:5])}")
        return sorted({index[n] for n in value})
    k = min(total, int(value)) if kind == "count" else min(total, math.floor(value * total + 0.5))
    return sorted(rng.sample(range(total), k))


def _number(text: str, what: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise CommandError(f"{what} {text!r} is not a number") from None
    if not (v >= 0 and math.isfinite(v)):
        raise CommandError(f"{what} must be a finite number >= 0, got {text!r}")
    return v


def parse_command(line: str) -> Command:
    words = line.split()
    if not words:
        raise CommandError("empty command; try: help")
    op, rest = words[0].lower(), words[1:]
    if op in PLAIN_OPS:
        if rest:
            raise CommandError(f"{op} takes no arguments")
        return Command(op)
    if op == "slow":
        if not 1 <= len(rest) <= 2:
            raise CommandError("usage: slow SECONDS [SHARE]")
        share = rest[1] if len(rest) == 2 else "1"
        parse_share(share)
        return Command(op, share, _number(rest[0], "SECONDS"))
    if op in SHARE_OPS:
        takes_arg = op in ("kill", "flap")
        if not rest or len(rest) > (2 if takes_arg else 1):
            raise CommandError(f"usage: {op} SHARE" + (" [SECONDS]" if takes_arg else ""))
        parse_share(rest[0])
        arg = _number(rest[1], "SECONDS") if len(rest) == 2 else None
        if op == "flap" and arg is not None and arg <= 0:
            raise CommandError("flap PERIOD must be > 0")
        return Command(op, rest[0], arg)
    raise CommandError(f"unknown command {op!r}; try: help")


