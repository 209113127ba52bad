# -*- coding: utf-8 -*-
# Copyright: llmgw maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""JSON Schema (Draft 2020-12) validation of a document against the llmgw schemas.

The schemas are the runtime's own files (``<name>.schema.json``, ``$id`` equal
to the file name, cross-file ``$ref`` by that name), read from a directory so
that the controller needs no llmgw installation. Errors are reported the way
the runtime reports them: every error at once, each with the JSON pointer of the
offending key, the deepest errors of a ``oneOf``, one error per unknown key.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

# jsonschema checks the "iri" formats with rfc3987_syntax when it is installed,
# which compiles a grammar on import (seconds, on every module run). The llmgw
# schemas use only "uri", so that import is left out.
sys.modules.setdefault("rfc3987_syntax", None)

JSONSCHEMA_IMPORT_ERROR = None
try:
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource
except ImportError:  # reported by the module with missing_required_lib
    Draft202012Validator = None
    Registry = Resource = None
    JSONSCHEMA_IMPORT_ERROR = traceback.format_exc()

SUFFIX = ".schema.json"


class SchemaLoadError(Exception):
    """A schema directory or file that cannot be used; the message names it."""


def load_schemas(directory):
    """Every ``<name>.schema.json`` in ``directory`` as ``{name: schema}``."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(SUFFIX))
    except OSError as exc:
        raise SchemaLoadError("cannot list schema directory %s: %s" % (directory, exc.strerror or exc))
    if not names:
        raise SchemaLoadError("no *%s files in %s" % (SUFFIX, directory))
    schemas = {}
    for filename in names:
        path = os.path.join(directory, filename)
        try:
            with open(path) as handle:
                schemas[filename[: -len(SUFFIX)]] = json.load(handle)
        except (OSError, ValueError) as exc:
            raise SchemaLoadError("%s: cannot read it as JSON: %s" % (path, exc))
    return schemas


def make_validator(schemas, name):
    """A validator for schema ``name`` whose ``$ref`` to another file resolves."""
    if name not in schemas:
        raise SchemaLoadError("no schema named %r; have %s" % (name, ", ".join(sorted(schemas))))
    registry = Registry()
    for schema_name, schema in schemas.items():
        resource = Resource.from_contents(schema)
        registry = registry.with_resources([(schema.get("$id", schema_name + SUFFIX), resource), (schema_name + SUFFIX, resource)])
    Draft202012Validator.check_schema(schemas[name])
    return Draft202012Validator(schemas[name], registry=registry, format_checker=Draft202012Validator.FORMAT_CHECKER)


def pointer(path):
    parts = [str(p).replace("~", "~0").replace("/", "~1") for p in path]
    return "/" + "/".join(parts) if parts else ""


def _leaves(error):
    # oneOf/anyOf wrap the useful errors: report the deepest, whose pointer names the wrong key.
    if error.context:
        best = max(len(e.absolute_path) for e in error.context)
        if best > len(error.absolute_path):
            out = []
            for sub in error.context:
                if len(sub.absolute_path) == best:
                    out.extend(_leaves(sub))
            return out
    return [error]


def _describe(error):
    if error.validator == "enum":
        return "%r is not one of %s" % (error.instance, ", ".join(repr(v) for v in error.validator_value))
    if error.validator == "type":
        return "expected %s, got %s %r" % (error.validator_value, type(error.instance).__name__, error.instance)
    return error.message


def document_errors(validator, document):
    """Every violation as ``{"pointer", "message"}``, de-duplicated and sorted by pointer."""
    found = set()
    for error in validator.iter_errors(document):
        for leaf in _leaves(error):
            where = pointer(leaf.absolute_path)
            if leaf.validator == "additionalProperties" and isinstance(leaf.instance, dict):
                known = leaf.schema.get("properties", {})
                for key in sorted(set(leaf.instance) - set(known)):
                    found.add(("%s/%s" % (where, key), "unknown key; allowed: %s" % ", ".join(sorted(known))))
            elif "propertyNames" in leaf.schema_path and isinstance(leaf.instance, str):
                # reported at the object holding the key; point at the key, as the runtime does
                key = leaf.instance.replace("~", "~0").replace("/", "~1")
                found.add(("%s/%s" % (where, key), _describe(leaf)))
            else:
                found.add((where, _describe(leaf)))
    return [{"pointer": p, "message": m} for p, m in sorted(found)]


def origin_of(where, origins):
    """The inventory variable a pointer comes from: ``/profiles/0/engine`` with
    ``{"/profiles": "llmgw_profiles"}`` -> ``llmgw_profiles[0].engine``; None when no prefix matches."""
    best = None
    for prefix in origins:
        bare = prefix.rstrip("/")
        if where == bare or where.startswith(bare + "/") or bare == "":
            if best is None or len(bare) > len(best.rstrip("/")):
                best = prefix
    if best is None:
        return None
    rest = where[len(best.rstrip("/")):].split("/")[1:]
    text = origins[best]
    for part in rest:
        part = part.replace("~1", "/").replace("~0", "~")
        text += "[%s]" % part if part.isdigit() else ".%s" % part
    return text
