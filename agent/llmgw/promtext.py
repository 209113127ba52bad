"""Reading samples out of a Prometheus text exposition (an engine's ``/metrics`` page).

The agent judges an engine's liveness from its counters (``agent/liveness``), reads its
autoscaling gauges (``enginesignals``), and the control plane proves a prefill/decode pair from
its transfer counters (``controlplane/pairproof``): one reading of the format for all three, so
a page they disagree about cannot exist. Only what they read must be right: a sample's name,
its label set as written, and its value; a trailing timestamp is ignored, and a line that does
not parse (a comment, a value that is not a number) is skipped.

Pure: text in, numbers out.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Iterator

# name, optional {labels} (a quoted value may hold braces and escaped quotes), blanks, the
# value; a timestamp may follow
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_REST = r'(\{(?:[^"}\n]|"(?:[^"\\\n]|\\.)*")*\})?[ \t]+(\S+)'
_SAMPLE = re.compile(rf"^({_NAME}){_REST}", re.M)


@functools.lru_cache(maxsize=64)
def _only(names: tuple[str, ...]) -> re.Pattern[str]:
    """A pattern anchored on these names: a page of a thousand lines is scanned about three times
    faster than by matching every line and dropping the other names afterwards."""
    return re.compile(rf"^({'|'.join(re.escape(n) for n in names)}){_REST}", re.M)


def samples(text: str, names: Collection[str] | None = None) -> Iterator[tuple[str, str, float]]:
    """(name, labels as written or "", value) of each sample line, only those of ``names`` when given.

    Values are floats as Prometheus writes them (``NaN``, ``+Inf`` included); a line whose value
    does not parse is skipped."""
    pattern = _SAMPLE if names is None else _only(tuple(sorted(names)))
    for m in pattern.finditer(text):
        name = m.group(1)
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        yield name, m.group(2) or "", value


def totals(text: str, names: Collection[str] | None = None) -> dict[str, float]:
    """Each name's samples summed over its label sets (only ``names`` when given; absent: not a key)."""
    out: dict[str, float] = {}
    for name, _labels, value in samples(text, names):
        out[name] = out.get(name, 0.0) + value
    return out


def total(text: str, name: str) -> float:
    """The sum of ``name``'s samples over every label set; 0 when the page has none."""
    return totals(text, (name,)).get(name, 0.0)
