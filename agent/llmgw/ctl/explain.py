"""``llmgw ctl explain``: where each declared replica would go, or why not.

The offline form (``--config server.yaml --hardware FILE...``) runs the same
pure placement the control plane runs, over hardware files, so an operator
can check a catalog against a fleet before anything is deployed.  Each file
becomes what its node would advertise by the agent's own function
(``llmgw.hardware.advertise``): GPUs whose ``health`` block makes them unfit
are withheld, and so are GPUs whose ``processes`` list a process (offline,
every listed process counts as not an engine).  Two files describing one
``node_id`` are an error naming both.  The text form shows each node's
topology matrix (``nvidia-smi topo -m`` style) when the file carries one.

A model without a declared ``size_bytes`` is sized from its weights when they
can be read from here: a local path that exists on this machine, or, with
``--probe-urls``, an https:// file's Content-Length or the sum of a
repository's file list (a mirror's manifest, an hf:// revision).  Otherwise the memory
check is skipped and the placement says so.

The online form (``ctl explain MODEL``) also says how many of the model's running replicas feed
route keys; whether a router routes the model by them is that router's own verdict (its
tokenizer parity check), which ``--router URL`` reads from each router's ``/healthz``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from typing import Any

from llmgw.catalog import weights_bytes
from llmgw.config import ConfigInvalid
from llmgw.hardware.advertise import advertise, listed_holders
from llmgw.hardware.types import HardwareInventory
from llmgw.placement import NodeCapacity, PlacementRequest, format_result, place_many
from llmgw.settings import ServerSettings, load_server_settings
from llmgw.weightprobe import measure_sources


def declared_requests(settings: ServerSettings, model: str | None = None,
                      known_sizes: Mapping[str, int] | None = None) -> list[tuple[str, PlacementRequest]]:
    """One request per declared replica, labelled ``model/profile#n``.

    ``known_sizes`` maps a model source to the size of its weights when it
    was measured (``llmgw.weightprobe.measure_sources``); a declared size wins.
    """
    out = []
    cat = settings.catalog
    for dep in cat.deployments:
        if model and model not in (dep.model, cat.models[dep.model].served_name):
            continue
        m, p = cat.models[dep.model], cat.profiles[dep.profile]
        size = weights_bytes(m, known_sizes)
        for n in range(dep.replicas):
            out.append((f"{dep.key}#{n}", PlacementRequest(
                model=m, profile=p, weights_bytes=size, memory_headroom=settings.memory_headroom)))
    return out


def advertised_offline(inv: HardwareInventory) -> HardwareInventory:
    """What the node of a hardware file would advertise: ``llmgw.hardware.advertise``, as the agent
    and the control plane apply it, with what only a live agent can know (which processes are its
    engines) decided the offline way.

    GPUs whose ``health`` block makes them unfit are withheld as the agent
    withholds them.  There is no telling an llmgw engine from anything else
    (the agent asks the live process for its LLMGW_SHARD_ID), so every
    process a file lists counts as not an engine, and the reason says so.
    A GPU whose processes are unknown (the key left out) is not withheld, as
    on the agent.
    """
    return advertise(inv, foreign=listed_holders).inventory


def explain_offline(settings: ServerSettings, inventories: list, model: str | None = None,
                    known_sizes: Mapping[str, int] | None = None) -> list[dict[str, Any]]:
    inventories = [advertised_offline(inv) for inv in inventories]
    nodes = [NodeCapacity(inventory=inv, free_gpus=frozenset(g.index for g in inv.gpus)) for inv in inventories]
    labelled = declared_requests(settings, model, known_sizes)
    results = place_many([r for _, r in labelled], nodes)
    report = []
    for (label, req), res in zip(labelled, results):
        report.append({
            "replica": label,
            "placed": res.ok,
            "weights_bytes": req.weights_bytes,
            "text": format_result(res, req),
            "placement": None if res.placement is None else {
                "rule": res.placement.rule,
                "detail": res.placement.detail,
                "fabric": res.placement.fabric,
                "shards": [{"node": s.node_id, "rank": s.rank, "gpus": list(s.gpu_indices), "env": s.env}
                           for s in res.placement.shards],
            },
            "reason": res.reason,
            "nodes": [{"node": v.node_id, "ok": v.ok, "reason": v.reason} for v in res.verdicts],
        })
    return report


def _cmd_explain(args: argparse.Namespace) -> int:
    if not args.config:
        online = getattr(args, "online_func", None)
        if online is None:
            print("llmgw ctl explain: --config and --hardware are required (the online form needs the "
                  "control-plane client)", file=sys.stderr)
            return 2
        return online(args)
    from llmgw.hardware.simulated import load_hardware_files

    try:
        settings = load_server_settings(args.config)
        inventories = load_hardware_files(args.hardware)
    except ConfigInvalid as e:
        print(e, file=sys.stderr)
        return 1
    if not inventories:
        print("llmgw ctl explain: --hardware FILE is required with --config", file=sys.stderr)
        return 2
    sizes = measure_sources(settings.catalog.models, remote=args.probe_urls)
    report = explain_offline(settings, inventories, args.model, sizes)
    if args.output == "json":
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        from llmgw.hardware.matrix import topo_matrix

        for inv in inventories:
            if inv.topology is not None:
                print(f"{inv.node_id} topology (nvidia-smi topo -m):")
                for line in topo_matrix(inv).splitlines():
                    print(f"  {line}")
        for item in report:
            print(f"{item['replica']}:")
            for line in item["text"].splitlines():
                print(f"  {line}")
    return 0 if all(r["placed"] for r in report) else 3


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "explain", help="show where each declared replica goes, or why not",
        epilog="exit status: 0 when every replica shown is placed, 3 when one or more cannot be "
               "(scripts and Ansible can tell 'will not fit' from an error, which exits 1)")
    p.add_argument("model", nargs="?", help="only this model (name or served name)")
    p.add_argument("--config", help="server.yaml (offline mode, with --hardware)")
    p.add_argument("--hardware", nargs="*", default=[], metavar="FILE", help="hardware files (offline mode)")
    p.add_argument("--probe-urls", action="store_true",
                   help="size fetched weights without a declared size_bytes: an https:// file by its Content-Length, "
                        "a repository mirror or hf:// repository by its file list (offline mode)")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text")
    p.add_argument("--router", action="append", default=[], metavar="URL",
                   help="a router (https://host:port, verified against --ca) to ask whether it routes MODEL "
                        "by its engines' route keys, and if not why (its GET /healthz; repeatable; online mode)")
    # Online form (`ctl explain MODEL` without --config): ask the running control plane.
    from llmgw.ctl.fleet import add_connection_args, explain_online

    add_connection_args(p)
    p.set_defaults(func=_cmd_explain, online_func=explain_online)
    return p
