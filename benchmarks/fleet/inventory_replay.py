"""``ansible-inventory`` through ``llmgw.fleet.llmgw`` at 10,000 nodes, without 10,000 simulated agents.

    .venv/bin/python benchmarks/fleet/inventory_replay.py [--capture 200] [--times 50]
        [--runs 3] [--modes graph list drift]

Starts a real control plane with ``--capture`` simulated 8-GPU agents (the
fleet benchmark's harness, same deployments filling about 80 % of the GPUs),
waits until every replica is Ready and records its answers to
``/v1/nodes``, ``/v1/replicas`` and ``/v1/catalog`` (kept under
``~/.cache/llmgw/fleet-bench/answers-N.json``, so a rerun skips the fleet).
Those answers are then replicated ``--times`` times (node, replica and shard ids
made distinct per copy, deployment counts multiplied) and served from memory on
loopback, and ``ansible-inventory --graph`` / ``--list`` is run ``--runs`` times
each. What is timed is the ansible-inventory process's own CPU (user + system
from ``os.times()`` of the waited child), which on a shared machine is steadier
than its wall clock. The control plane's time to render the answers is not in
it (the fleet benchmark's ``reads`` phase measures the whole path).

``drift`` runs ``playbooks/drift.yml`` as an operator does, with a declared
inventory of the same nodes (agents, their version, the deployments) beside
the plugin's source; it must find no drift, and ``ansible-playbook``'s CPU
(its forks included) is what is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.support, for the harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inventory"))

from bench import TOKEN, serve  # noqa: E402  (the inventory benchmark's loopback server)
from harness import Fleet, declared_inventory  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CACHE = Path.home() / ".cache/llmgw/fleet-bench"
PATHS = ("/v1/nodes", "/v1/replicas", "/v1/catalog")


def capture(n: int) -> dict[str, Any]:
    path = CACHE / f"answers-{n}.json"
    if path.exists():
        return json.loads(path.read_text())
    with tempfile.TemporaryDirectory() as d:
        f = Fleet(Path(d), n, procs=1, lifecycle={"startup_grace": 5})
        try:
            f.start_server()
            f.start_sim()
            t0 = time.monotonic()
            while not f.converged():
                if time.monotonic() - t0 > 300:
                    raise SystemExit("the captured fleet did not converge in 300 s")
                time.sleep(1)
            answers = {p: f.get(p) for p in PATHS}
        finally:
            f.stop()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(answers))
    os.replace(tmp, path)
    return answers


def replicate(answers: dict[str, Any], times: int) -> dict[str, bytes]:
    """``times`` copies of the captured fleet, as one fleet: node, replica and shard ids made distinct per copy."""
    nodes = answers["/v1/nodes"]
    all_nodes: list[Any] = []
    all_reps: list[Any] = []
    for k in range(times):
        def nid(i: str) -> str:
            return i if not k else f"{i}-c{k}"

        def sid(s: str | None) -> str | None:  # REPLICA/rRANK -> REPLICA-cK/rRANK
            if not k or not s:
                return s
            rid, _, rank = s.rpartition("/")
            return f"{rid}-c{k}/{rank}"

        for n in json.loads(json.dumps(nodes["nodes"])):
            n["node_id"] = nid(n["node_id"])
            if n.get("hardware"):
                n["hardware"]["node_id"] = n["node_id"]
            for g in n.get("gpus") or ():
                g["shard"] = sid(g.get("shard"))
            all_nodes.append(n)
        for r in json.loads(json.dumps(answers["/v1/replicas"]["replicas"])):
            if k:
                r["replica_id"] = f"{r['replica_id']}-c{k}"
            for s in r.get("shards") or ():
                s["shard_id"] = sid(s.get("shard_id"))
                s["node_id"] = nid(s["node_id"]) if s.get("node_id") else s.get("node_id")
            all_reps.append(r)
    catalog = json.loads(json.dumps(answers["/v1/catalog"]))
    for d in catalog.get("deployments", ()):
        d["replicas"] *= times
    replicas = {**answers["/v1/replicas"], "replicas": all_reps}
    return {"/v1/nodes": json.dumps({**nodes, "nodes": all_nodes}).encode(),
            "/v1/replicas": json.dumps(replicas).encode(),
            "/v1/catalog": json.dumps(catalog).encode()}


def run_once(config: Path, mode: str) -> tuple[float, int, bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "LLMGW_"))}
    env.update(ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED="true",
               ANSIBLE_INVENTORY_CACHE="false", LLMGW_TOKEN=TOKEN)
    before = os.times()
    p = subprocess.run([str(BIN / "ansible-inventory"), "-i", str(config), f"--{mode}"], cwd=REPO, env=env,
                       capture_output=True, timeout=600)
    after = os.times()
    if p.returncode:
        raise SystemExit(f"ansible-inventory --{mode} failed: {p.stderr.decode()[-2000:]}")
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return cpu, len(p.stdout), p.stdout


def run_drift(config: Path, declared: Path, report: Path) -> tuple[float, dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "LLMGW_"))}
    env.update(ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED="true",
               ANSIBLE_INVENTORY_CACHE="false", LLMGW_TOKEN=TOKEN)
    before = os.times()
    p = subprocess.run([str(BIN / "ansible-playbook"), "-i", str(declared), "-i", str(config),
                        str(REPO / "playbooks" / "drift.yml"), "-e", "drift_format=json", "-e", f"drift_report={report}"],
                       cwd=REPO, env=env, capture_output=True, timeout=1800)
    after = os.times()
    if p.returncode:
        raise SystemExit(f"drift.yml failed: {p.stdout.decode()[-3000:]}{p.stderr.decode()[-2000:]}")
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return cpu, json.loads(report.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capture", type=int, default=200, help="nodes of the simulated fleet whose answers are recorded")
    ap.add_argument("--times", type=int, default=50, help="copies of it served as one fleet")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", nargs="+", choices=("graph", "list", "drift"), default=["graph", "list"])
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="a plugin option")
    args = ap.parse_args()
    docs = replicate(capture(args.capture), args.times)
    nodes = json.loads(docs["/v1/nodes"])["nodes"]
    hosts = len(nodes)
    server, url = serve(docs)
    out: dict[str, Any] = {"nodes": hosts, "api_bytes": sum(map(len, docs.values())), "load_before": os.getloadavg()}
    try:
        with tempfile.TemporaryDirectory() as d:
            config = Path(d) / "replay.llmgw.yml"
            config.write_text(json.dumps({"plugin": "llmgw.fleet.llmgw", "url": url,
                                          **dict(o.split("=", 1) for o in args.option)}))
            for mode in [m for m in args.modes if m == "drift"]:
                declared = Path(d) / "declared.yml"
                declared.write_text(json.dumps(declared_inventory(nodes, json.loads(docs["/v1/catalog"]))))
                cpus = []
                for _ in range(args.runs):
                    cpu, report = run_drift(config, declared, Path(d) / "drift.json")
                    cpus.append(round(cpu, 2))
                    assert report["ok"] and int(report["declared_nodes"]) == hosts, report["summary"]
                out[mode] = {"cpu_s": cpus, "median_cpu_s": round(statistics.median(cpus), 2),
                             "spread_s": round(max(cpus) - min(cpus), 2), "summary": report["summary"]}
                print(f"drift.yml {hosts} nodes: CPU {cpus} s (median {out[mode]['median_cpu_s']}): "
                      f"{report['summary']}", flush=True)
            for mode in [m for m in args.modes if m != "drift"]:
                cpus, size = [], 0
                for _ in range(args.runs):
                    cpu, size, text = run_once(config, mode)
                    cpus.append(round(cpu, 2))
                if mode == "list":
                    assert len(json.loads(text)["_meta"]["hostvars"]) == hosts
                out[mode] = {"cpu_s": cpus, "median_cpu_s": round(statistics.median(cpus), 2),
                             "spread_s": round(max(cpus) - min(cpus), 2), "output_bytes": size}
                print(f"--{mode} {hosts} nodes: CPU {cpus} s (median {out[mode]['median_cpu_s']}), "
                      f"output {size / 1e6:.1f} MB", flush=True)
    finally:
        server.shutdown()
        server.server_close()
    out["load_after"] = os.getloadavg()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
