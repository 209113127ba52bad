"""Configuration defaults, read from the one place they are stated: the schemas.

A default written in a schema (``"default": 30``) is what the configuration
reference shows operators, so it is also what the parsers must use.  Before,
the same number stood in the schema, in the settings dataclass and again as
``section.get("key", 30)`` at parse time, and nothing noticed when one of the
three changed.  Now the parsers fill a document's absent keys from its
schema (``with_defaults``) and read every key plainly; the dataclasses keep
their field defaults only for code that builds them directly, and
``tests/unit/test_settings_defaults.py`` holds those equal to the schema.

A section absent from the file is filled only where its schema says
``"default": {}`` (then its own keys' defaults follow); a section whose
absence means something (``ha``, ``engine_tls``, ``router``) has no default.
"""

from __future__ import annotations

import copy
from typing import Any

from llmgw.config import load_schema


def with_defaults(doc: Any, schema_name: str) -> Any:
    """A copy of ``doc`` with every absent key that schema ``schema_name`` gives a default filled in.

    Safe on a document the schema refused: only mappings are filled, and a
    value of the wrong type is left as it is for the schema errors to name.
    """
    schema = load_schema(schema_name)
    return _fill(copy.deepcopy(doc), schema, schema)


def section_defaults(schema_name: str, pointer: str = "") -> dict[str, Any]:
    """``{key: default}`` for the object at ``pointer`` in schema ``schema_name``.

    ``pointer`` walks properties (``/api/clients``); ``[]`` steps into an
    array's items (``/profiles/[]``).  Raises KeyError for an unknown key.
    """
    raw = root = load_schema(schema_name)
    node, root = _resolve(raw, root)
    for key in [k for k in pointer.split("/") if k]:
        raw = node["items"] if key == "[]" else node["properties"][key]
        node, root = _resolve(raw, root)
    out = {}
    for key, sub_raw in node.get("properties", {}).items():
        has, default = _default(sub_raw, _resolve(sub_raw, root)[0])
        if has:
            out[key] = default
    return out


def _resolve(node: dict[str, Any], root: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``node`` with its ``$ref`` followed (within ``root``, or to another schema file), and that node's root."""
    ref = node.get("$ref")
    if not isinstance(ref, str):
        return node, root
    doc, _, frag = ref.partition("#")
    if doc:
        root = load_schema(doc.removesuffix(".schema.json"))
    target = root
    for part in frag.strip("/").split("/") if frag else ():
        target = target[part]
    return _resolve(target, root)


def _default(raw: dict[str, Any], node: dict[str, Any]) -> tuple[bool, Any]:
    """The default beside a ``$ref`` wins over the one in what it names."""
    for where in (raw, node):
        if "default" in where:
            return True, where["default"]
    return False, None


def _fill(value: Any, raw: dict[str, Any], root: dict[str, Any]) -> Any:
    node, root = _resolve(raw, root)
    if isinstance(value, dict):
        for key, sub_raw in node.get("properties", {}).items():
            if key not in value:
                has, default = _default(sub_raw, _resolve(sub_raw, root)[0])
                if not has:
                    continue
                value[key] = copy.deepcopy(default)
            value[key] = _fill(value[key], sub_raw, root)
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(value):
            value[i] = _fill(item, node["items"], root)
    return value
