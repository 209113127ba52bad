"""Simulated nodes' hardware: board templates, a mix of them, per-node identities.

A template is a hardware file (schema ``hardware``, the document a node
reports in ``register``) describing one board; the templates shipped here sit
in ``templates/`` and any other hardware file can be added by path.  Each
simulated node gets one template and its own identities, derived from the
node id so a rerun reports exactly the same fleet:

* GPU UUIDs: ``GPU-<uuid5(node id, index)>``, unique across the fleet as real
  UUIDs are;
* PCI bus ids: the template's bus/device/function with the PCI domain set
  from the node's number, so no two GPUs of the fleet share a bus id either
  (code that keys GPUs by bus id across nodes would be caught);
* ``node_id`` is the node's, ``gpu_source`` is ``simulated``.

Everything else (names, memory, NVLink peers, adapters, fabrics and their
rates) is the template's, so a fabric declared in a template is one fabric
shared by every node built from it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from llmgw.hardware.simulated import inventory_from_document, read_hardware_document
from llmgw.hardware.types import HardwareInventory

TEMPLATE_DIR = Path(__file__).parent / "templates"
UUID_NAMESPACE = uuid.UUID("5b0c4f64-6f1e-4b8e-9a55-6c6c6d67770a")  # llmgw fleet simulator

# The default fleet: 8-GPU boxes only, so "N nodes" means 8N GPUs, with two
# InfiniBand fabrics at different rates for two-node replicas.
DEFAULT_MIX = "hgx-h100-8gpu=50,hgx-h100-8gpu-ib-ndr=20,hgx-a100-8gpu-ib-hdr=20,pcie-8gpu-nvlink-pairs=10"


class MixError(ValueError):
    """A ``--mix`` or template that cannot be used; the message says which part and why."""


def builtin_templates() -> dict[str, Path]:
    return {p.stem: p for p in sorted(TEMPLATE_DIR.glob("*.yaml"))}


def load_templates(extra: Mapping[str, str | Path] = ()) -> dict[str, dict[str, Any]]:
    """Every template's validated document: the built-in ones plus ``extra`` (name -> file)."""
    paths: dict[str, Path] = {**builtin_templates(), **{k: Path(v) for k, v in dict(extra).items()}}
    return {name: read_hardware_document(path) for name, path in paths.items()}


@dataclass(frozen=True)
class MixPart:
    template: str
    weight: float


def parse_mix(text: str, known: Sequence[str]) -> tuple[MixPart, ...]:
    """``NAME=WEIGHT,NAME=WEIGHT`` (weights are relative; a bare NAME weighs 1)."""
    parts: list[MixPart] = []
    seen: set[str] = set()
    for item in (s.strip() for s in text.split(",")):
        if not item:
            raise MixError(f"--mix {text!r}: empty entry")
        name, _, weight = item.partition("=")
        name = name.strip()
        if name not in known:
            raise MixError(f"--mix: unknown template {name!r}; known: {', '.join(sorted(known))}")
        if name in seen:
            raise MixError(f"--mix: template {name!r} given twice")
        seen.add(name)
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise MixError(f"--mix: weight of {name!r} is not a number: {weight!r}") from None
        if not w >= 0 or w == float("inf"):
            raise MixError(f"--mix: weight of {name!r} must be a finite number >= 0, got {weight!r}")
        parts.append(MixPart(name, w))
    if not any(p.weight > 0 for p in parts):
        raise MixError(f"--mix {text!r}: at least one weight must be > 0")
    return tuple(parts)


def allocate(mix: Sequence[MixPart], nodes: int) -> list[str]:
    """The template of each of ``nodes`` nodes: counts by largest remainder, in contiguous blocks."""
    total = sum(p.weight for p in mix)
    exact = [p.weight * nodes / total for p in mix]
    counts = [int(e) for e in exact]
    by_remainder = sorted(range(len(mix)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: nodes - sum(counts)]:
        counts[i] += 1
    out: list[str] = []
    for p, c in zip(mix, counts):
        out += [p.template] * c
    return out


def gpu_uuid(node_id: str, index: int) -> str:
    return f"GPU-{uuid.uuid5(UUID_NAMESPACE, f'{node_id}/{index}')}"


def pci_bus_id(template_bus_id: str, node_number: int) -> str:
    """The template's ``bus:device.function`` in PCI domain ``node_number`` (mod 2**16)."""
    _, _, rest = template_bus_id.partition(":")
    return f"{node_number % 0x10000:08X}:{rest}"


def node_document(template: Mapping[str, Any], node_id: str, node_number: int) -> dict[str, Any]:
    """``template`` as node ``node_id`` (the ``node_number``-th of the fleet) reports it."""
    doc = dict(template)
    doc["node_id"] = node_id
    doc["gpu_source"] = "simulated"
    doc["gpus"] = [{**g, "uuid": gpu_uuid(node_id, int(g["index"])),
                    "pci_bus_id": pci_bus_id(str(g["pci_bus_id"]), node_number)} for g in template["gpus"]]
    return doc


def node_inventory(template: Mapping[str, Any], node_id: str, node_number: int) -> HardwareInventory:
    return inventory_from_document(node_document(template, node_id, node_number), node_id=node_id)
