"""Checks against single definitions of the stream schema.

The stream schema is a ``oneOf`` over every message type; for a document of
a known kind its errors list every other kind's mismatch too.  Validating
against the kind's own definition (``$defs/<kind>``) names the field that is
really wrong, and lets the agent check a stored shard spec the same way the
control plane will check it inside ``register``.
"""

from __future__ import annotations

import functools
from typing import Any

from jsonschema import Draft202012Validator

from llmgw.config import fast_check, load_schema


@functools.cache
def _validator(definition: str) -> Draft202012Validator:
    stream = load_schema("stream")
    return Draft202012Validator({"$defs": stream["$defs"], **stream["$defs"][definition]},
                                format_checker=Draft202012Validator.FORMAT_CHECKER)


def definition_problems(definition: str, doc: Any) -> list[str]:
    """Every violation of ``$defs/<definition>`` by ``doc``, as "pointer: message"."""
    if fast_check("stream", definition)(doc):
        return []
    errors = sorted(_validator(definition).iter_errors(doc), key=lambda e: [str(p) for p in e.absolute_path])
    return ["/" + "/".join(str(p) for p in e.absolute_path) + f": {e.message}" for e in errors]
