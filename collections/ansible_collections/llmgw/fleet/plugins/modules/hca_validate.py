#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llmgw maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: hca_validate
short_description: Check declared InfiniBand / RoCE adapters against a node's sysfs
version_added: 0.1.0
description:
  - Compares the adapters an inventory declares for each fabric of a node with
    what the kernel publishes under C(/sys/class/infiniband).
  - Fails, naming the node, the fabric and the adapter, when a declared adapter
    is absent (listing the adapters that are present), when none of its ports
    is C(ACTIVE) (saying which state each port is in, for example C(INIT) with
    C(LinkUp) when no subnet manager runs), when a port is C(ACTIVE) but not
    C(LinkUp), when a port's link layer differs from the fabric's (InfiniBand
    and RoCE cannot talk to each other), when a card is not the one recorded in
    O(fabrics[].identities), when an ACTIVE port's rate cannot be read, or when
    the fabric runs below its O(fabrics[].min_rate_gbps).
  - The rules and their words are the agent's own (the same file runs on every
    discovery), and a port claimed by two fabrics is refused before anything is read.
  - Fabric membership cannot be read from the wire (every subnet has the same
    default prefix), so only what is declared is checked; adapters that are
    present but not declared are reported in RV(undeclared_hcas).
  - Read-only; it never changes anything on the node.
author:
  - llmgw maintainers (!UNKNOWN)
options:
  fabrics:
    description:
      - The fabrics this node is on, in the shape of C(agent.yaml)'s C(fabrics).
      - An empty list checks nothing and succeeds.
    type: list
    elements: dict
    required: true
    suboptions:
      name:
        description: Fabric name.
        type: str
        required: true
      hcas:
        description:
          - Adapter names under C(/sys/class/infiniband), for example C(mlx5_0) (every port), or single ports in
            NCCL's spelling, C(mlx5_0:1). A port belongs to one fabric.
        type: list
        elements: str
        required: true
      min_rate_gbps:
        description: Slowest acceptable rate of an ACTIVE port, in Gb/s.
        type: float
      link_layer:
        description:
          - The fabric's kind. Left out, it is taken from the first usable port; ports of the other kind fail.
        type: str
        choices: [InfiniBand, Ethernet]
      identities:
        description:
          - Adapter name to its recorded C(node_guid) and C(pci_bus_id) (a previous run's RV(identities)). A card
            found under a declared name with another identity fails, naming where the recorded card went.
        type: dict
  sysfs_root:
    description:
      - The directory holding one entry per RDMA adapter. Point it at a fixture tree in tests.
      - The same setting as C(discovery.sysfs_root) in C(agent.yaml).
    type: path
    default: /sys/class/infiniband
  node_id:
    description:
      - Name of the node in messages. Defaults to the host name the module runs on.
    type: str
attributes:
  check_mode:
    support: full
    description: The module only reads; check mode runs the same checks.
  diff_mode:
    support: none
    description: Nothing is changed, so there is nothing to show.
  platform:
    support: full
    platforms: posix
    description: Reads the Linux RDMA sysfs tree.
notes:
  - Parsing follows the kernel's C(drivers/infiniband/core/sysfs.c) formats. A file
    that is missing or malformed leaves its field C(UNKNOWN) and says why in the
    port's C(reason); such a port never counts as ACTIVE unless its C(state) said so.
"""

EXAMPLES = r"""
- name: Check the adapters of the compute fabric
  llmgw.fleet.hca_validate:
    node_id: "{{ inventory_hostname }}"
    fabrics:
      - name: ib-compute
        hcas: [mlx5_0, mlx5_1]
        min_rate_gbps: 200
  register: fabric

- name: Show the slowest link
  ansible.builtin.debug:
    msg: "{{ fabric.fabric_rate_gbps }} Gb/s"

- name: Check against a recorded sysfs tree
  llmgw.fleet.hca_validate:
    sysfs_root: /srv/fixtures/sysfs/healthy/class/infiniband
    fabrics:
      - name: ib0
        hcas: [mlx5_0]
"""

RETURN = r"""
ok:
  description: Whether every declared adapter is present with an ACTIVE port at an acceptable rate.
  returned: always
  type: bool
  sample: true
node_id:
  description: The node named in messages.
  returned: always
  type: str
  sample: gpu-a1
fabric_rate_gbps:
  description: The slowest ACTIVE link among the declared adapters, in Gb/s; null when none is ACTIVE.
  returned: always
  type: float
  sample: 200.0
checks:
  description: One entry per declared adapter.
  returned: always
  type: list
  elements: dict
  contains:
    fabric:
      description: Fabric the adapter is declared on.
      type: str
      returned: always
      sample: ib-compute
    hca:
      description: Adapter name.
      type: str
      returned: always
      sample: mlx5_0
    present:
      description: Whether the adapter exists under O(sysfs_root).
      type: bool
      returned: always
    ok:
      description: Whether this adapter passed every check.
      type: bool
      returned: always
    node_guid:
      description: The adapter's node GUID, when present.
      type: str
      returned: always
      sample: b83f:d203:0012:a4e0
    active_ports:
      description: Numbers of the ports whose state is ACTIVE.
      type: list
      elements: int
      returned: always
      sample: [1]
    rate_gbps:
      description: Slowest ACTIVE port of this adapter, in Gb/s.
      type: float
      returned: always
      sample: 200.0
    ports:
      description: Every port as sysfs shows it (port, state, phys_state, rate_gbps, rate_text, link_layer, reason).
      type: list
      elements: dict
      returned: always
    problems:
      description: What is wrong with this adapter, each naming it.
      type: list
      elements: str
      returned: always
fabrics:
  description: One status per declared fabric, in the shape the agent reports (declared, advertised, rate, problems).
  returned: always
  type: list
  elements: dict
  sample:
    - name: ib-compute
      declared_hcas: [mlx5_0, mlx5_1]
      advertised_hcas: [mlx5_0, mlx5_1]
      rate_gbps: 100.0
      slowest_link: mlx5_1 port 1, 100 Gb/sec (4X EDR)
      problems: []
identities:
  description:
    - Every adapter present, by name, with its C(node_guid) and C(pci_bus_id); record it as
      C(fabrics[].identities) in C(agent.yaml) so the agent notices a rename.
  returned: always
  type: dict
  sample: {mlx5_0: {node_guid: "b83f:d203:0012:a4e0", pci_bus_id: "0000:17:00.0"}}
undeclared_hcas:
  description: Adapters present that no declared fabric names; reported, never used.
  returned: always
  type: list
  elements: str
  sample: [mlx5_2]
problems:
  description: Every problem found, each naming its fabric and adapter.
  returned: always
  type: list
  elements: str
  sample: ["fabric ib-compute: mlx5_1: absent (found: mlx5_0, mlx5_2)"]
"""

import socket

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.llmgw.fleet.plugins.module_utils.infiniband import (
    check_fabrics,
    identities,
    read_adapters,
)
from ansible_collections.llmgw.fleet.plugins.module_utils.fabric_rules import declaration_errors


def main():
    module = AnsibleModule(
        argument_spec=dict(
            fabrics=dict(
                type="list",
                elements="dict",
                required=True,
                options=dict(
                    name=dict(type="str", required=True),
                    hcas=dict(type="list", elements="str", required=True),
                    min_rate_gbps=dict(type="float"),
                    link_layer=dict(type="str", choices=["InfiniBand", "Ethernet"]),
                    identities=dict(type="dict"),
                ),
            ),
            sysfs_root=dict(type="path", default="/sys/class/infiniband"),
            node_id=dict(type="str"),
        ),
        supports_check_mode=True,
    )
    node_id = module.params["node_id"] or socket.gethostname()
    for index, fabric in enumerate(module.params["fabrics"]):
        if not fabric["hcas"]:
            module.fail_json(msg="%s: fabric %s (fabrics[%d]) declares no adapters" % (node_id, fabric["name"], index))
    clashes = declaration_errors(module.params["fabrics"])
    if clashes:
        module.fail_json(msg="%s: %s" % (node_id, "; ".join("%s: %s" % c for c in clashes)))
    adapters = read_adapters(module.params["sysfs_root"])
    checks, fabrics, undeclared, problems = check_fabrics(module.params["fabrics"], adapters)
    rates = [f["rate_gbps"] for f in fabrics if f["rate_gbps"] is not None]
    result = dict(
        changed=False,
        ok=not problems,
        node_id=node_id,
        checks=checks,
        fabrics=fabrics,
        undeclared_hcas=undeclared,
        identities=identities(adapters),
        fabric_rate_gbps=min(rates) if rates else None,
        problems=problems,
    )
    if problems:
        module.fail_json(msg="%s: %s" % (node_id, "; ".join(problems)), **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
