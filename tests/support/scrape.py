"""What the suites and the benchmarks read off a process's ``/metrics`` page: named counters summed.

One reading of the text format for the product and its measurements alike (``llmgw.promtext``).
"""

from __future__ import annotations

import urllib.request

from llmgw import promtext


def scrape(url: str, names: tuple[str, ...], labels: str = "", timeout: float = 30.0) -> dict[str, float]:
    """Each named metric's samples on ``url``'s ``/metrics`` summed, only those whose label set
    contains ``labels``; 0 for a name the page does not show. A page that cannot be read raises
    (``OSError``): a figure read as 0 from a process that did not answer would be a wrong figure."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out = {n: 0.0 for n in names}
    for name, labelset, value in promtext.samples(text, names):
        if labels in labelset:
            out[name] += value
    return out
