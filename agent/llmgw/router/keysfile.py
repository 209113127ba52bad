"""A keys file beside ``router.yaml``: the API keys that change without touching the router's config.

``router.yaml``'s ``api_keys_file`` names a YAML file holding ``api_keys:``
entries of the same shape as ``router.yaml``'s own (name, sha256, models,
limits).  Keys are issued and revoked far more often than the rest of the
configuration changes, and by different hands: ``llmgw ctl keys`` edits this
file on a router host, or Ansible renders it from vault variables, while
``router.yaml`` stays as deployed.  A changed keys file is put in force by
SIGHUP (``limitsreload``), so a revoke drops no stream in flight.

The file holds only SHA-256 digests, never a key.  Its errors name the file
and the JSON pointer inside it; a key name in both files is refused, so which
entry is in force is never a question.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from llmgw.config import ConfigError, ConfigInvalid, read_yaml, schema_errors
from llmgw.schemadefaults import with_defaults

from .settings import duplicate_key_errors, key_limits_errors

FIELD = "api_keys_file"


def resolve(config_path: str | Path, keys_file: str) -> Path:
    """``keys_file`` as named in ``router.yaml``: relative names are relative to that file's directory."""
    p = Path(keys_file)
    return p if p.is_absolute() else Path(config_path).parent / p


def keys_file_errors(doc: Any) -> list[ConfigError]:
    """Every problem of a keys file's document, by JSON pointer inside that file."""
    if doc is None:
        return []
    if not isinstance(doc, dict):
        return [ConfigError("", f"expected a mapping with api_keys, got {type(doc).__name__}")]
    errors = [ConfigError(f"/{k}", "unknown key; allowed: api_keys") for k in doc if k != "api_keys"]
    keys = doc.get("api_keys")
    if keys is None:
        return errors
    if not isinstance(keys, list):
        return errors + [ConfigError("/api_keys", f"expected a list, got {type(keys).__name__}")]
    for i, item in enumerate(keys):
        shape = schema_errors(item, "router", "api_key")
        errors += [ConfigError(f"/api_keys/{i}{e.pointer}", e.message) for e in shape]
        if isinstance(item, dict) and not shape and "limits" in item:
            full = with_defaults({"api_keys": [item]}, "router")["api_keys"][0]
            errors += key_limits_errors(full, f"/api_keys/{i}")
    errors += duplicate_key_errors(keys)
    return errors


def read_keys(path: str | Path) -> list[dict[str, Any]]:
    """The ``api_keys`` entries of a keys file; ``ConfigInvalid`` naming the file and each pointer."""
    doc = read_yaml(path)
    errors = keys_file_errors(doc)
    if errors:
        raise ConfigInvalid(str(path), errors)
    return list((doc or {}).get("api_keys") or [])


def with_keys_file(doc: Mapping[str, Any], config_path: str | Path) -> dict[str, Any]:
    """``router.yaml``'s document with the keys of its ``api_keys_file`` appended to ``api_keys``.

    A document without the field, or whose field is not a string (the schema
    reports it), comes back as it was.
    """
    out = dict(doc)
    name = doc.get(FIELD)
    if not isinstance(name, str) or not name:
        return out
    path = resolve(config_path, name)
    extra = read_keys(path)
    inline = doc.get("api_keys") if isinstance(doc.get("api_keys"), list) else []
    inline_names = {k.get("name"): i for i, k in enumerate(inline) if isinstance(k, dict)}
    clashes = [ConfigError(f"/api_keys/{i}/name", f"key {k['name']!r} is also in {config_path} /api_keys/"
                           f"{inline_names[k['name']]}; keep it in one file")
               for i, k in enumerate(extra) if k["name"] in inline_names]
    if clashes:
        raise ConfigInvalid(str(path), clashes)
    out["api_keys"] = list(inline) + extra
    return out


def validated_with_keys_file(doc: Any, config_path: str | Path) -> Any:
    """``with_keys_file`` for a check of ``router.yaml`` (``llmgw config validate``): a problem of the
    keys file is reported at ``/api_keys_file``, naming the file and the pointer inside it, so a
    name in both files is caught before a router restarts into a configuration it would refuse."""
    if not isinstance(doc, dict):
        return doc
    try:
        return with_keys_file(doc, config_path)
    except ConfigInvalid as e:
        raise ConfigInvalid(str(config_path), [ConfigError("/api_keys_file", f"{e.source}: {err}")
                                               for err in e.errors]) from None
