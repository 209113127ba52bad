"""What the collection's Grafana dashboard queries, and what a live ``/metrics`` declares: the
two sides the dashboard checks compare (llmgw's own processes, and the real engines)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "collections/ansible_collections/llmgw/fleet/roles/monitoring/files/llmgw-dashboard.json"

_SERIES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
           "summary": ("_sum", "_count", "_created"), "gauge": ("",), "untyped": ("",)}


def scrape(url: str, client: httpx.Client | None = None) -> set[str]:
    """The series names one ``/metrics`` scrape declares: those with samples, and those a
    process declares (``# TYPE``) before any sample, e.g. an error counter with no error yet."""
    text = (client.get(url) if client else httpx.get(url, timeout=30)).raise_for_status().text
    names = set()
    for fam in text_string_to_metric_families(text):
        names.update(s.name for s in fam.samples)
        names.update(fam.name + suffix for suffix in _SERIES.get(fam.type, ("",)))
    return names


# PromQL: an identifier followed by a label matcher, a range or a closing
# paren/operator, that is not a function, keyword or label name.
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_NOT_METRICS = {
    "sum", "rate", "irate", "increase", "histogram_quantile", "by", "without", "max", "min", "avg",
    "count", "topk", "bottomk", "le", "on", "ignoring", "group_left", "group_right", "and", "or",
    "unless", "clamp_min", "clamp_max", "abs", "time", "vector", "label_replace", "sort", "sort_desc",
    "delta", "deriv", "offset", "bool",
}


def promql_metrics(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers outside ``{...}`` and ``[...]`` that are
    neither functions, aggregation keywords nor the labels after ``by``/``without``."""
    expr = re.sub(r"\{[^}]*\}", "", expr)      # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)     # ranges
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)  # grouping labels
    expr = re.sub(r'"[^"]*"', "", expr)         # string arguments
    names = set()
    for m in _IDENT.finditer(expr):
        word = m.group(0)
        if word in _NOT_METRICS or re.fullmatch(r"\d.*", word):
            continue
        if expr[m.end():].lstrip().startswith("("):  # a function call
            continue
        names.add(word)
    return names


def dashboard_metrics() -> dict[str, set[str]]:
    """Each metric the dashboard queries, with the titles of the panels that query it."""
    doc = json.loads(DASHBOARD.read_text())
    found: dict[str, set[str]] = {}
    for panel in doc["panels"]:
        for target in panel.get("targets", []):
            for name in promql_metrics(target["expr"]):
                found.setdefault(name, set()).add(panel["title"])
    for var in doc.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            m = re.fullmatch(r"label_values\((\w+),\s*\w+\)", var["definition"])
            assert m, f"template variable {var['name']}: {var['definition']!r} is not label_values(METRIC, LABEL)"
            found.setdefault(m.group(1), set()).add(f"${var['name']}")
    return found
