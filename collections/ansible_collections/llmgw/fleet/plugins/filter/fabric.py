# -*- coding: utf-8 -*-
# Copyright: llmgw maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Adapter identities recorded at rollout, joined to the declared fabrics.

A reboot can swap the names of two cards on different fabrics; every declared
name is still present and ACTIVE, and NCCL would use the wrong cards. The
fabric role records each declared adapter's PCI address and node GUID the first
time it validates a node, and every later check (the role's, and the agent's on
every discovery) compares against that record.
"""

from __future__ import annotations

from ansible.errors import AnsibleFilterError


def _adapter(hca):
    """``mlx5_0:1`` -> ``mlx5_0``: identities belong to cards, not ports."""
    return str(hca).split(":", 1)[0]


def fabric_identities(fabrics, recorded):
    """Each declared fabric with C(identities) for its adapters found in ``recorded``.

    Identities the inventory declares itself are kept as they are; an adapter
    with no record gets none (it is recorded on the next successful check).
    """
    if not isinstance(fabrics, list):
        raise AnsibleFilterError("fabric_identities: expected the list of declared fabrics, got %s" % type(fabrics).__name__)
    recorded = recorded or {}
    if not isinstance(recorded, dict):
        raise AnsibleFilterError("fabric_identities: the record must be a mapping of adapter name to identity")
    out = []
    for fabric in fabrics:
        fabric = dict(fabric)
        if not fabric.get("identities"):
            known = dict((a, recorded[a]) for a in sorted(set(_adapter(h) for h in fabric.get("hcas", ())))
                         if a in recorded)
            if known:
                fabric["identities"] = known
            else:
                fabric.pop("identities", None)
        out.append(fabric)
    return out


def declared_identities(identities, fabrics):
    """The identities (hca_validate's RV(identities)) of the adapters the fabrics declare, and only those."""
    names = set(_adapter(h) for f in fabrics or () for h in f.get("hcas", ()))
    return dict((k, v) for k, v in sorted((identities or {}).items()) if k in names)


class FilterModule(object):
    """llmgw fabric filters."""

    def filters(self):
        return {
            "fabric_identities": fabric_identities,
            "declared_identities": declared_identities,
        }
