"""Render the configuration reference (docs/configuration.md) from the schemas.

The reference is generated, never written by hand, and a test fails when the
committed file differs from what the schemas say: the docs cannot drift.
Regenerate with ``python -m llmgw.schemas_doc > docs/configuration.md``.
"""

from __future__ import annotations

import json
from typing import Any

from llmgw.config import load_schema

FILES = [
    ("server", "server.yaml", "Control plane and in-process router: `llmgw server --config server.yaml`."),
    ("router", "router section / router.yaml", "The router: the `router:` section of server.yaml, or the whole file for `llmgw router --config router.yaml`."),
    ("agent", "agent.yaml", "Node agent: `llmgw agent --config agent.yaml`."),
    ("repository", "llmgw-manifest.json (repository mirror)", "The manifest a plain http(s) model repository mirror serves beside its files; a model whose `source` is an http(s) URL ending in `/` names such a directory."),
    ("hardware", "hardware file", "What discovery reports about a node; also the simulated hardware source (tests, demos, the fleet simulator)."),
]


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    ref = node.get("$ref")
    if not ref:
        return node, None
    if ref.startswith("#/$defs/"):
        return _resolve(schema, schema["$defs"][ref.split("/")[-1]])
    return node, ref  # another file


def _type(schema: dict[str, Any], node: dict[str, Any]) -> str:
    if "enum" in node:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in node["enum"])
    if "const" in node:
        return f"`{json.dumps(node['const'])}`"
    t = node.get("type", "")
    if isinstance(t, list):
        t = " \\| ".join(t)
    if t == "array" and isinstance(node.get("items"), dict):
        item, other = _resolve(schema, node["items"])
        inner = _type(schema, item) if not other else "object"
        t = f"array of {inner}" if inner else t
    return t


def _bounds(node: dict[str, Any]) -> str:
    parts = []
    for key, sym in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<")):
        if key in node:
            parts.append(f"{sym} {node[key]}")
    if "pattern" in node:
        parts.append(f"pattern `{node['pattern']}`")
    if "format" in node:
        parts.append(f"format {node['format']}")
    return ", ".join(parts)


def _rows(schema: dict[str, Any], node: dict[str, Any], prefix: str, required: set[str], out: list[str]) -> None:
    for key, raw in node.get("properties", {}).items():
        sub, other = _resolve(schema, raw)
        path = f"{prefix}{key}"
        desc = (sub.get("description") or raw.get("description") or "").replace("|", "\\|")
        if other:
            desc = (desc + " " if desc else "") + f"See {other.removesuffix('.schema.json')}."
        # a default beside a $ref ({"$ref": "#/$defs/seconds", "default": 2}) is the key's own
        stated = raw if "default" in raw else sub
        default = f"`{json.dumps(stated['default'])}`" if "default" in stated else ""
        req = "yes" if key in required else ""
        out.append(f"| `{path}` | {_type(schema, sub) or ('object' if other else '')} | {req} | {default} | "
                   f"{_bounds(sub)} | {desc} |")
        if sub.get("type") == "object" and "properties" in sub:
            _rows(schema, sub, path + ".", set(sub.get("required", ())), out)
        items = sub.get("items")
        if isinstance(items, dict):
            item, _ = _resolve(schema, items)
            if item.get("type") == "object" and "properties" in item:
                _rows(schema, item, path + "[].", set(item.get("required", ())), out)


def render_reference() -> str:
    out = [
        "# Configuration reference",
        "",
        "Generated from the JSON Schemas in `agent/llmgw/schemas/` by `python -m llmgw.schemas_doc`;",
        "a test fails when this file and the schemas disagree. Every object rejects unknown keys.",
        "Durations are seconds. Validate a file with `llmgw config validate FILE`: every error is listed",
        "with the JSON pointer of the offending key.",
        "",
    ]
    for name, title, blurb in FILES:
        try:
            schema = load_schema(name)
        except KeyError:
            continue
        out += [f"## {title}", "", blurb, ""]
        if schema.get("description"):
            out += [schema["description"], ""]
        out += ["| key | type | required | default | constraints | description |",
                "| --- | --- | --- | --- | --- | --- |"]
        _rows(schema, schema, "", set(schema.get("required", ())), out)
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render_reference(), end="")
