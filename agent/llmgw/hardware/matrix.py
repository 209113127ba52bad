"""A node's topology as ``nvidia-smi topo -m`` prints it, for ``ctl explain`` and the docs.

GPU rows and columns, then one column per RDMA adapter (its tier to each
GPU from their PCI paths), then each GPU's CPU and NUMA affinity.  ``?``
marks a tier the node could not read, ``N/A`` an affinity it does not know.
"""

from __future__ import annotations

from llmgw.hardware.topology import label, pci_tier
from llmgw.hardware.types import HardwareInventory

WIDTH = 8


def topo_matrix(inv: HardwareInventory) -> str:
    gpus = sorted(inv.gpus, key=lambda g: g.index)
    links = inv.topology.as_map() if inv.topology is not None else {}
    nics = list(inv.hcas)
    head = " " * WIDTH + "".join(f"{'GPU%d' % g.index:<{WIDTH}}" for g in gpus)
    head += "".join(f"{'NIC%d' % i:<{WIDTH}}" for i in range(len(nics)))
    rows = [head + "CPU Affinity    NUMA Affinity"]
    for a in gpus:
        cells = [f"{'GPU%d' % a.index:<{WIDTH}}"]
        for b in gpus:
            if a.index == b.index:
                cell = "X"
            else:
                link = links.get((min(a.index, b.index), max(a.index, b.index)))
                if link is not None and link.tier is not None:
                    cell = label(link.tier, link.nvlinks)
                elif inv.nvlink_known and b.index in a.nvlink_peers:
                    cell = "NV"
                else:
                    cell = "?"
            cells.append(f"{cell:<{WIDTH}}")
        for h in nics:
            cells.append(f"{label(pci_tier(a.pci_path, a.numa_node, h.pci_path, h.numa_node)):<{WIDTH}}")
        cells.append(f"{a.cpu_affinity or 'N/A':<16}{'N/A' if a.numa_node is None else a.numa_node}")
        rows.append("".join(cells).rstrip())
    if nics:
        rows.append("")
        rows.append("NIC Legend:")
        rows.extend(f"  NIC{i}: {h.name}" for i, h in enumerate(nics))
    return "\n".join(rows)
