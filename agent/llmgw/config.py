"""Configuration loading and JSON Schema validation.

Every file and every stream message has a Draft 2020-12 schema under
``llmgw/schemas/``.  Validation reports *every* error at once, each with the
JSON pointer of the offending key, so an operator fixes a file in one pass;
nothing starts on an invalid file.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterable
from urllib.parse import urlsplit

import yaml
from jsonschema import Draft202012Validator, FormatChecker
from jsonschema.exceptions import ValidationError
from referencing import Registry, Resource


@dataclass(frozen=True, order=True)
class ConfigError:
    """One problem in one document: where (JSON pointer) and what."""

    pointer: str  # "/profiles/0/engine"; "" for the document root
    message: str

    def __str__(self) -> str:
        return f"{self.pointer or '/'}: {self.message}"


class ConfigInvalid(Exception):
    """Raised with every error of a document; str() lists them one per line."""

    def __init__(self, source: str, errors: Iterable[ConfigError]):
        self.source = source
        self.errors = sorted(errors)
        lines = [f"{source}: {len(self.errors)} error(s)"] + [f"  {e}" for e in self.errors]
        super().__init__("\n".join(lines))


def _schema_files() -> dict[str, dict[str, Any]]:
    out = {}
    root = resources.files("llmgw") / "schemas"
    for entry in root.iterdir():
        if entry.name.endswith(".schema.json"):
            out[entry.name.removesuffix(".schema.json")] = json.loads(entry.read_text())
    return out


@functools.cache
def _registry() -> Registry:
    reg = Registry()
    for name, schema in _schema_files().items():
        res = Resource.from_contents(schema)
        reg = reg.with_resource(schema.get("$id", f"{name}.schema.json"), res)
        reg = reg.with_resource(f"{name}.schema.json", res)
    return reg


@functools.cache
def load_schema(name: str) -> dict[str, Any]:
    """The schema called ``name`` (file ``schemas/<name>.schema.json``)."""
    schemas = _schema_files()
    if name not in schemas:
        raise KeyError(f"no schema named {name!r}; have {sorted(schemas)}")
    return schemas[name]


def _is_uri(value: object) -> bool:
    if not isinstance(value, str):
        return True
    parts = urlsplit(value)
    return bool(parts.scheme and parts.netloc) and not any(c.isspace() for c in value)


# Only the formats our schemas use, checked with the standard library. The
# jsonschema extras pull in grammar compilers that cost seconds at every
# start of every llmgw command.
FORMAT_CHECKER = FormatChecker(formats=())
FORMAT_CHECKER.checks("uri")(_is_uri)
for _fmt in ("ipv4", "ipv6", "email", "date", "regex"):
    FORMAT_CHECKER.checkers[_fmt] = Draft202012Validator.FORMAT_CHECKER.checkers[_fmt]


@functools.cache
def validator(name: str, definition: str | None = None) -> Draft202012Validator:
    """Validator for schema ``name``, or for one of its ``$defs`` entries.

    Validating a stream message against the definition its ``type`` names
    gives errors about that message ("/seq: -1 is less than 0"), where the
    schema's top-level ``oneOf`` would only say which other types it is not.
    """
    schema = load_schema(name)
    Draft202012Validator.check_schema(schema)
    if definition is not None:
        if definition not in schema.get("$defs", {}):
            raise KeyError(f"schema {name!r} has no definition {definition!r}")
        schema = {"$id": f"{name}-{definition}.schema.json", "$defs": schema["$defs"],
                  "$ref": f"#/$defs/{definition}"}
    return Draft202012Validator(
        schema,
        registry=_registry(),
        format_checker=FORMAT_CHECKER,
    )


def _bundle(name: str) -> dict[str, Any]:
    """Schema ``name`` with every schema it references folded into its ``$defs``.

    The compiled validator resolves references within one document only;
    the schema files stay the one source, this is only their shape.
    """
    schemas = _schema_files()
    out: dict[str, Any] = {"$defs": {}}
    imported: set[str] = set()

    def rewrite(node: Any, prefix: str) -> Any:
        if isinstance(node, list):
            return [rewrite(v, prefix) for v in node]
        if not isinstance(node, dict):
            return node
        new = {k: rewrite(v, prefix) for k, v in node.items() if k not in ("$id", "$schema")}
        ref = node.get("$ref")
        if isinstance(ref, str):
            doc, _, frag = ref.partition("#")
            target = doc.removesuffix(".schema.json") if doc else None
            pre = prefix if target is None else f"{target}__"
            if target is not None and target not in imported:
                imported.add(target)
                take(target)
            new["$ref"] = f"#/$defs/{pre}{frag.removeprefix('/$defs/')}" if frag else f"#/$defs/{pre}"
        return new

    def take(schema_name: str) -> None:
        schema = schemas[schema_name]
        pre = f"{schema_name}__"
        for key, sub in schema.get("$defs", {}).items():
            out["$defs"][pre + key] = rewrite(sub, pre)
        out["$defs"][pre] = rewrite({k: v for k, v in schema.items() if k != "$defs"}, pre)

    imported.add(name)
    take(name)
    return out


@functools.cache
def fast_check(name: str, definition: str | None = None) -> Callable[[Any], bool]:
    """A compiled validator for schema ``name`` (or one of its ``$defs``): True when valid.

    Thousands of agents validating their messages with ``jsonschema`` would
    cost the control plane seconds of CPU per registration storm; the
    compiled form answers "valid" in microseconds.  It only ever decides
    that a document is valid: anything it refuses is checked again by
    ``schema_errors``, which has the final say and the readable errors.
    """
    import fastjsonschema

    bundle = _bundle(name)
    entry = f"{name}__{definition}" if definition is not None else f"{name}__"
    if entry not in bundle["$defs"]:
        raise KeyError(f"schema {name!r} has no definition {definition!r}")
    compiled = fastjsonschema.compile({"$schema": "http://json-schema.org/draft-07/schema#",
                                       "$defs": bundle["$defs"], "$ref": f"#/$defs/{entry}"},
                                      use_default=False, use_formats=False)

    def check(doc: Any) -> bool:
        try:
            compiled(doc)
        except fastjsonschema.JsonSchemaException:
            return False
        return True

    return check


def _pointer(err: ValidationError) -> str:
    parts = [str(p).replace("~", "~0").replace("/", "~1") for p in err.absolute_path]
    return "/" + "/".join(parts) if parts else ""


def _leaf_errors(err: ValidationError) -> list[ValidationError]:
    # oneOf/anyOf wrap the useful errors; report the deepest ones so the
    # pointer names the key that is really wrong.
    if err.context:
        best = max(len(e.absolute_path) for e in err.context)
        if best > len(err.absolute_path):
            out: list[ValidationError] = []
            for sub in err.context:
                if len(sub.absolute_path) == best:
                    out.extend(_leaf_errors(sub))
            return out
    return [err]


def _describe(err: ValidationError) -> str:
    if err.validator == "enum":
        return f"{err.instance!r} is not one of {', '.join(map(repr, err.validator_value))}"
    if err.validator == "type":
        return f"expected {err.validator_value}, got {type(err.instance).__name__} {err.instance!r}"
    return err.message


def schema_errors(doc: Any, schema_name: str, definition: str | None = None,
                  limit: int | None = None) -> list[ConfigError]:
    """Every schema violation of ``doc``, de-duplicated, sorted by pointer.

    ``limit``: stop looking after that many.  For input from the network:
    a 4 MiB array of a million wrong items would otherwise keep the event
    loop busy for many seconds collecting errors nobody reads.
    """
    errors: set[ConfigError] = set()
    for err in validator(schema_name, definition).iter_errors(doc):
        if limit is not None and len(errors) >= limit:
            break
        for leaf in _leaf_errors(err):
            pointer = _pointer(leaf)
            if leaf.validator == "additionalProperties":
                # One error per unknown key, pointing at the key itself.
                known = leaf.schema.get("properties", {})
                for key in sorted(set(leaf.instance) - set(known)):
                    errors.add(ConfigError(f"{pointer}/{key}", f"unknown key; allowed: {', '.join(sorted(known))}"))
            elif "propertyNames" in leaf.schema_path and isinstance(leaf.instance, str):
                # jsonschema reports a badly named key at the object holding it; point at the key.
                errors.add(ConfigError(f"{pointer}/{leaf.instance.replace('~', '~0').replace('/', '~1')}",
                                       _describe(leaf)))
            else:
                errors.add(ConfigError(pointer, _describe(leaf)))
    return sorted(errors)


def validate_document(doc: Any, schema_name: str, source: str = "<document>") -> None:
    """Raise ``ConfigInvalid`` listing every error, or return quietly."""
    errors = schema_errors(doc, schema_name)
    if errors:
        raise ConfigInvalid(source, errors)


def read_yaml(path: str | Path) -> Any:
    """Parse a YAML (or JSON) file; a syntax error is a ``ConfigInvalid`` with its line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigInvalid(str(path), [ConfigError("", f"cannot read: {e.strerror}")]) from e
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigInvalid(str(path), [ConfigError("", f"{where}not valid YAML: {e}")]) from e
