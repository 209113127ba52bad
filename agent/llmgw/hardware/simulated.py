"""Hardware from a file: the source for tests, demos and the fleet simulator.

A hardware file is the document real discovery produces
(``HardwareInventory.to_dict()``, schema ``hardware``), in YAML or JSON, so a
real node's report can be saved and replayed, and a hand-written file means
exactly what a node would have reported.  Nothing here touches a device; a
production node uses ``gpu_source: nvml``.

How a file becomes an inventory:

* it is validated against the ``hardware`` schema, then checked for what a
  schema cannot say (GPU indices unique, NVLink peers naming GPUs of the
  file, adapter names and port numbers unique); every error is reported at
  once with its JSON pointer;
* ``node_id`` is the agent's own (its certificate's identity), not the file's,
  and ``gpu_source`` is ``simulated``: the GPUs did not come from NVML;
* NVLink peers are made symmetric, as NVML-derived peers are;
* a GPU's optional ``processes`` stand for what NVML would list on it (the
  agent withholds a GPU whose process is not one of its engines); leaving
  the key out means "unknown", as when NVML cannot be asked;
* if the file has ``hcas`` and the agent declares fabrics, the fabric status
  and the undeclared adapters are recomputed from those adapters with
  ``validate_fabrics``, exactly as on a real node, and the file's own
  ``fabrics`` / ``undeclared_hcas`` are ignored.  Otherwise they are kept as
  written (a file can describe a fabric outcome for a demo).  A file without
  ``hcas`` leaves adapters to sysfs (see ``llmgw.hardware.discover``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from llmgw.config import ConfigError, ConfigInvalid, read_yaml, schema_errors
from llmgw.hardware.infiniband import validate_fabrics
from llmgw.hardware.types import GPU, FabricDeclaration, HardwareInventory

SCHEMA = "hardware"


def semantic_errors(doc: Mapping[str, Any]) -> list[ConfigError]:
    """What the schema cannot check, for a document that passed it."""
    return _gpu_errors(doc) + _hca_errors(doc) + _topology_errors(doc)


def document_errors(doc: Any) -> list[ConfigError]:
    """Every error of a hardware document: the schema's, then the semantic ones.

    The GPU and adapter checks each run when the schema accepted the section
    they read, so a typo in ``hcas`` does not hide a duplicate GPU index, and
    a schema-invalid section never yields a second, misleading error.  An
    error at the root (not a mapping, a required key missing) stops them all.
    """
    errors = schema_errors(doc, SCHEMA)
    if any(e.pointer == "" for e in errors):
        return errors
    bad = {e.pointer.split("/")[1] for e in errors}
    if "gpus" not in bad:
        errors += _gpu_errors(doc)
    if "hcas" not in bad:
        errors += _hca_errors(doc)
    if "topology" not in bad and "gpus" not in bad:
        errors += _topology_errors(doc)
    return errors


def _topology_errors(doc: Mapping[str, Any]) -> list[ConfigError]:
    """Each pair names two GPUs of the file, once, and agrees with nvlink_peers."""
    topology = doc.get("topology")
    if topology is None:
        return []
    gpus = doc.get("gpus", ())
    peers = {g["index"]: set(g.get("nvlink_peers", ())) for g in gpus}
    errors: list[ConfigError] = []
    seen: dict[tuple[int, int], int] = {}
    for j, link in enumerate(topology.get("links", ())):
        where = f"/topology/links/{j}"
        a, b = link["gpus"]
        missing = [x for x in (a, b) if x not in peers]
        if missing:
            errors.append(ConfigError(f"{where}/gpus", f"no GPU with index {missing[0]} in this file"))
            continue
        key = (min(a, b), max(a, b))
        if key in seen:
            errors.append(ConfigError(f"{where}/gpus", f"duplicate pair {list(key)} (also /topology/links/{seen[key]})"))
            continue
        seen[key] = j
        nv = link.get("tier") == "NV"
        listed = b in peers[a] or a in peers[b]
        if nv != listed:
            say = "NV but neither GPU lists the other in nvlink_peers" if nv else (
                f"{link.get('tier')} but nvlink_peers join GPUs {a} and {b}")
            errors.append(ConfigError(f"{where}/tier", say))
    return errors


def _gpu_errors(doc: Mapping[str, Any]) -> list[ConfigError]:
    gpus = doc.get("gpus", ())
    errors = _duplicates(gpus, "index", "/gpus", "GPU index")
    indices = {g["index"] for g in gpus}
    for i, g in enumerate(gpus):
        for j, peer in enumerate(g.get("nvlink_peers", ())):
            where = f"/gpus/{i}/nvlink_peers/{j}"
            if peer == g["index"]:
                errors.append(ConfigError(where, f"GPU {peer} cannot be its own NVLink peer"))
            elif peer not in indices:
                errors.append(ConfigError(where, f"no GPU with index {peer} in this file"))
        errors += _duplicates(g.get("processes") or (), "pid", f"/gpus/{i}/processes", "pid")
    return errors


def _hca_errors(doc: Mapping[str, Any]) -> list[ConfigError]:
    hcas = doc.get("hcas", ())
    errors = _duplicates(hcas, "name", "/hcas", "adapter")
    for i, h in enumerate(hcas):
        errors += _duplicates(h.get("ports", ()), "port", f"/hcas/{i}/ports", "port")
    return errors


def _duplicates(items: Any, key: str, pointer: str, what: str) -> list[ConfigError]:
    """An error at each item whose ``key`` an earlier item of ``items`` already has."""
    errors: list[ConfigError] = []
    first: dict[Any, int] = {}
    for j, item in enumerate(items):
        value = item[key]
        if value in first:
            errors.append(ConfigError(f"{pointer}/{j}/{key}", f"duplicate {what} {value!r} (also {pointer}/{first[value]})"))
        else:
            first[value] = j
    return errors


def read_hardware_document(path: str | Path) -> dict[str, Any]:
    """The file's document, validated; ``ConfigInvalid`` lists every error with its pointer."""
    doc = read_yaml(path)
    errors = document_errors(doc)
    if errors:
        raise ConfigInvalid(str(path), errors)
    return doc


def _symmetric(gpus: Sequence[GPU]) -> tuple[GPU, ...]:
    peers: dict[int, set[int]] = {g.index: set(g.nvlink_peers) for g in gpus}
    for g in gpus:
        for p in g.nvlink_peers:
            peers[p].add(g.index)
    return tuple(dataclasses.replace(g, nvlink_peers=tuple(sorted(peers[g.index]))) for g in gpus)


def inventory_from_document(
    doc: Mapping[str, Any],
    *,
    node_id: str | None = None,
    fabrics: Sequence[FabricDeclaration] = (),
) -> HardwareInventory:
    """Turn a validated document into the inventory this node advertises (rules above)."""
    inv = HardwareInventory.from_dict(dict(doc))
    inv = dataclasses.replace(
        inv,
        node_id=node_id or inv.node_id,
        gpu_source="simulated",
        gpus=_symmetric(inv.gpus),
    )
    if "hcas" in doc and fabrics:
        statuses, undeclared = validate_fabrics(fabrics, inv.hcas)
        inv = dataclasses.replace(inv, fabrics=statuses, undeclared_hcas=undeclared)
    return inv


def load_hardware_file(
    path: str | Path,
    *,
    node_id: str | None = None,
    fabrics: Sequence[FabricDeclaration] = (),
) -> HardwareInventory:
    """Read, validate and interpret a hardware file (see the module docstring)."""
    return inventory_from_document(read_hardware_document(path), node_id=node_id, fabrics=fabrics)


def load_hardware_files(paths: Sequence[str | Path]) -> list[HardwareInventory]:
    """Several hardware files, one node each: ``load_hardware_file`` on every one.

    Two files describing the same ``node_id`` are refused, naming both: taken
    as two nodes they would be one node to placement (its GPUs counted once,
    the second file's silently lost), and ``ctl explain`` would answer "will
    not fit" where the real answer is "you gave the same node twice".
    """
    inventories = [load_hardware_file(p) for p in paths]
    first: dict[str, str] = {}
    errors: list[ConfigError] = []
    for path, inv in zip(paths, inventories):
        if inv.node_id in first:
            errors.append(ConfigError("/node_id", f"duplicate node_id {inv.node_id!r}: {first[inv.node_id]} and "
                                                  f"{path} describe the same node"))
        else:
            first[inv.node_id] = str(path)
    if errors:
        raise ConfigInvalid(", ".join(str(p) for p in paths), errors)
    return inventories
