#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llmgw maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: schema_validate
short_description: Validate a document against one of the llmgw JSON Schemas
version_added: 0.1.0
description:
  - Validates O(document) against the JSON Schema (Draft 2020-12) called O(schema)
    among the C(*.schema.json) files in O(schema_dir), the runtime's own schemas.
  - Cross-file C($ref) between the schemas (for example C(server) to C(router))
    resolve through a registry of every file in O(schema_dir).
  - Reports every error at once, each with the JSON pointer of the offending key,
    and fails when there is any, so a declared fleet is checked before any host is touched.
  - Read-only.
author:
  - llmgw maintainers (!UNKNOWN)
requirements:
  - jsonschema >= 4.18
  - referencing
options:
  document:
    description: The document, for example the C(server.yaml) the inventory declares, as data.
    type: raw
    required: true
  schema:
    description: Schema name, the file name without C(.schema.json), for example C(server), C(agent), C(hardware).
    type: str
    required: true
  schema_dir:
    description: Directory holding the C(<name>.schema.json) files.
    type: path
    required: true
  source:
    description: What the document is, for messages (for example C(agent.yaml of gpu-a1)).
    type: str
    default: document
  origins:
    description:
      - 'Where parts of the document come from, as JSON pointer prefix to variable name,
        for example C({"/profiles": "llmgw_profiles"}).'
      - Each error then also names the variable to fix, for example C(llmgw_profiles[0].engine).
    type: dict
    default: {}
attributes:
  check_mode:
    support: full
    description: The module only reads; check mode validates the same way.
  diff_mode:
    support: none
    description: Nothing is changed, so there is nothing to show.
  platform:
    support: full
    platforms: posix
    description: Any host with Python and jsonschema; usually the controller.
"""

EXAMPLES = r"""
- name: Validate the declared control-plane configuration
  llmgw.fleet.schema_validate:
    document: "{{ llmgw_server_config }}"
    schema: server
    schema_dir: "{{ playbook_dir }}/../agent/llmgw/schemas"
    source: server.yaml of {{ inventory_hostname }}
  delegate_to: localhost
"""

RETURN = r"""
valid:
  description: Whether the document satisfies the schema.
  returned: always
  type: bool
  sample: false
schema:
  description: The schema the document was checked against.
  returned: always
  type: str
  sample: server
errors:
  description: Every violation, sorted by pointer.
  returned: always
  type: list
  elements: dict
  contains:
    pointer:
      description: JSON pointer of the offending key; empty for the document itself.
      type: str
      returned: always
      sample: /profiles/0/engine
    message:
      description: What is wrong there.
      type: str
      returned: always
      sample: "'vlm' is not one of 'vllm', 'sglang', 'llamacpp'"
    origin:
      description: The variable that holds the offending value, when O(origins) says; else null.
      type: str
      returned: always
      sample: llmgw_profiles[0].engine
"""

from ansible.module_utils.basic import AnsibleModule, missing_required_lib
from ansible_collections.llmgw.fleet.plugins.module_utils.schema import (
    JSONSCHEMA_IMPORT_ERROR,
    SchemaLoadError,
    document_errors,
    load_schemas,
    make_validator,
    origin_of,
)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            document=dict(type="raw", required=True),
            schema=dict(type="str", required=True),
            schema_dir=dict(type="path", required=True),
            source=dict(type="str", default="document"),
            origins=dict(type="dict", default={}),
        ),
        supports_check_mode=True,
    )
    if JSONSCHEMA_IMPORT_ERROR:
        module.fail_json(msg=missing_required_lib("jsonschema and referencing"), exception=JSONSCHEMA_IMPORT_ERROR)
    name, source = module.params["schema"], module.params["source"]
    try:
        validator = make_validator(load_schemas(module.params["schema_dir"]), name)
        errors = document_errors(validator, module.params["document"])
    except SchemaLoadError as exc:
        module.fail_json(msg="%s: %s" % (source, exc), valid=False, schema=name, errors=[])
    except Exception as exc:  # an unresolvable $ref, a schema that is itself invalid
        module.fail_json(
            msg="%s: schema %s cannot be used with the files in %s: %s" % (source, name, module.params["schema_dir"], exc),
            valid=False, schema=name, errors=[],
        )
    for error in errors:
        error["origin"] = origin_of(error["pointer"], module.params["origins"])
    result = dict(changed=False, valid=not errors, schema=name, errors=errors)
    if errors:
        lines = "; ".join(
            "%s%s: %s" % (e["pointer"] or "/", " (%s)" % e["origin"] if e["origin"] else "", e["message"]) for e in errors
        )
        module.fail_json(msg="%s: %d error(s) against the %s schema: %s" % (source, len(errors), name, lines), **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
