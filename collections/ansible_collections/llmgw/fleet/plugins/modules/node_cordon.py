#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llmgw maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: node_cordon
short_description: Cordon, drain or uncordon a GPU node through the llmgw control plane
version_added: 0.1.0
description:
  - Sets a node's cordon through the control plane's admin API, as C(llmgw ctl cordon|drain|uncordon) does.
  - V(cordoned) places nothing new on the node; what runs there stays.
  - V(drained) cordons it and moves its replicas to other nodes one at a time, each replacement Ready
    before the old replica is drained (make before break). With O(wait) the task returns once no replica
    is left on the node, and fails after O(timeout) with what the drain is waiting for.
  - V(schedulable) lifts a cordon (and stops a drain; a move under way finishes).
  - The control plane records a cordon in its C(state_dir) (the collection sets it) before it answers, so the cordon
    survives a control-plane restart; a control plane without C(state_dir) holds cordons in memory only, and after it
    restarts the task must run again.
  - Reads only the one node (C(GET /v1/nodes/NODE)), also every O(poll_interval) while it waits for a drain,
    never the fleet's list, whatever the fleet's size.
author:
  - llmgw maintainers (!UNKNOWN)
options:
  api_url:
    description: The control plane's API, for example C(https://cp.example:8443).
    type: str
    required: true
  ca_path:
    description: The fleet CA certificate the API is verified against.
    type: path
    required: true
  client_cert:
    description: An admin client certificate. Give it with O(client_key), or give O(token).
    type: path
  client_key:
    description: The admin client certificate's key.
    type: path
  token:
    description: An admin bearer token instead of a certificate.
    type: str
  node:
    description: The node id, as C(llmgw ctl nodes) lists it (the inventory host name).
    type: str
    required: true
  state:
    description: What the node should be.
    type: str
    choices: [cordoned, drained, schedulable]
    default: cordoned
  wait:
    description: With O(state=drained), wait until no replica is left on the node.
    type: bool
    default: true
  timeout:
    description: Seconds O(wait) may take.
    type: float
    default: 1800
  poll_interval:
    description: Seconds between checks while waiting.
    type: float
    default: 2
attributes:
  check_mode:
    support: full
    description: Reads the node's cordon and reports what would change; sends nothing.
  diff_mode:
    support: full
    description: Shows the cordon before and after.
  platform:
    support: full
    platforms: posix
    description: Talks HTTPS to the control plane; runs anywhere, usually delegated to the controller.
"""

EXAMPLES = r"""
- name: Drain a node for maintenance
  llmgw.fleet.node_cordon:
    api_url: https://cp.example:8443
    ca_path: /etc/llmgw/pki/ca.crt
    client_cert: /etc/llmgw/pki/admin.crt
    client_key: /etc/llmgw/pki/admin.key
    node: gpu-07
    state: drained
  delegate_to: localhost

- name: Put it back into service
  llmgw.fleet.node_cordon:
    api_url: https://cp.example:8443
    ca_path: /etc/llmgw/pki/ca.crt
    client_cert: /etc/llmgw/pki/admin.crt
    client_key: /etc/llmgw/pki/admin.key
    node: gpu-07
    state: schedulable
  delegate_to: localhost
"""

RETURN = r"""
node:
  description: The node's cordon as the control plane reports it after the task.
  returned: always
  type: dict
  sample: {"node_id": "gpu-07", "cordon": "draining", "replicas_left": 0, "drained": true, "drain_blocked": null}
was:
  description: The cordon before the task (null when the node was schedulable).
  returned: always
  type: str
  sample: cordoned
"""

import json
import time
import urllib.error
import urllib.parse

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.urls import open_url
from ansible_collections.llmgw.fleet.plugins.module_utils.fleet_states import CORDONED, DRAINING

# The module's states (what the node should be) -> the cordon the API reports for it.
WANT = {"cordoned": CORDONED, "drained": DRAINING, "schedulable": None}
ACTION = {"cordoned": "cordon", "drained": "drain", "schedulable": "uncordon"}


class ApiError(Exception):
    pass


class Api:
    def __init__(self, params):
        self.base = params["api_url"].rstrip("/")
        self.tls = {"ca_path": params["ca_path"], "client_cert": params.get("client_cert"),
                    "client_key": params.get("client_key")}
        self.headers = {"Authorization": "Bearer " + params["token"]} if params.get("token") else {}

    def call(self, method, path):
        try:
            resp = open_url(self.base + path, method=method, data=b"" if method == "POST" else None,
                            headers=self.headers, timeout=30, validate_certs=True, use_proxy=False, **self.tls)
            with resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            body = e.read().decode("utf-8", "replace")
            try:
                body = json.loads(body).get("error", body)
            except ValueError:
                pass
            raise ApiError(f"{method} {path}: HTTP {e.code}: {body}")
        except (urllib.error.URLError, OSError) as e:
            raise ApiError(f"{method} {path}: cannot reach {self.base}: {e}")

    def node(self, node_id):
        """The node's cordon, read from GET /v1/nodes/NODE: one node, not the fleet's list, every poll."""
        path = "/v1/nodes/" + urllib.parse.quote(node_id, safe="")
        try:
            n = self.call("GET", path)
        except ApiError as e:
            if "HTTP 404: no route " in str(e):
                raise ApiError(f"GET {path}: the control plane at {self.base} has no such route: it is older than "
                               f"this collection; upgrade it (playbooks/upgrade.yml) before cordoning with it") from e
            raise
        return {k: n.get(k) for k in ("node_id", "cordon", "replicas_left", "drained", "drain_blocked")}


def main():
    module = AnsibleModule(
        argument_spec=dict(
            api_url=dict(type="str", required=True),
            ca_path=dict(type="path", required=True),
            client_cert=dict(type="path"),
            client_key=dict(type="path", no_log=False),  # a path, not the key
            token=dict(type="str", no_log=True),
            node=dict(type="str", required=True),
            state=dict(type="str", choices=list(WANT), default="cordoned"),
            wait=dict(type="bool", default=True),
            timeout=dict(type="float", default=1800),
            poll_interval=dict(type="float", default=2),
        ),
        required_together=[("client_cert", "client_key")],
        required_one_of=[("client_cert", "token")],
        supports_check_mode=True,
    )
    p = module.params
    try:
        api = Api(p)
        before = api.node(p["node"])
    except (ApiError, OSError) as e:
        module.fail_json(msg=str(e))
    want = WANT[p["state"]]
    changed = before["cordon"] != want
    diff = {"before": {"cordon": before["cordon"]}, "after": {"cordon": want}}
    if module.check_mode:
        module.exit_json(changed=changed, node=before, was=before["cordon"], diff=diff)
    node = before
    try:
        if changed:
            node = api.call("POST", f"/v1/nodes/{urllib.parse.quote(p['node'], safe='')}/{ACTION[p['state']]}")["node"]
        if p["state"] == "drained" and p["wait"]:
            end = time.monotonic() + p["timeout"]
            node = api.node(p["node"])
            while not node.get("drained"):
                if time.monotonic() >= end:
                    module.fail_json(msg=f"node {p['node']} not drained after {p['timeout']:g}s: "
                                         f"{node.get('replicas_left')} replica(s) left"
                                         + (f"; waiting: {node['drain_blocked']}" if node.get("drain_blocked") else ""),
                                     changed=changed, node=node, was=before["cordon"])
                time.sleep(p["poll_interval"])
                node = api.node(p["node"])
    except ApiError as e:
        module.fail_json(msg=str(e), changed=changed)
    module.exit_json(changed=changed, node=node, was=before["cordon"], diff=diff)


if __name__ == "__main__":
    main()
