"""``ansible-inventory`` (--list, --export, --graph) through llmgw.fleet.llmgw on fleets of 1k, 5k and 10k nodes.

    .venv/bin/python benchmarks/inventory/bench.py [--sizes 1000 5000 10000] [--runs 3]
        [--modes list export graph] [--option gpu_detail=full] [--no-write]

The API answers are the recorded answers of a real control plane
(tests/inventory/recorded/) scaled up: every node is the recorded node
``a`` under a new id with 4 GPUs and the recorded fabric, and carries 4
single-GPU shards (so 10,000 nodes hold 40,000 shards), each a copy of the
recorded Ready replica spread over 8 models. They are served from memory by a
threaded HTTP server on loopback with the admin-token check, so what is timed
is the plugin's whole path: the ansible-inventory process starting, three (or
more) API requests, JSON decoding, building the inventory, and printing it.
The control plane's own time to render /v1/nodes for such a fleet is not in
these figures (it is the control plane's to measure).

Modes: ``list`` is ``--list`` (the figure that matters); ``export`` is
``--list --export`` (group variables stay on their groups, host variables are
not merged per host); ``graph`` is ``--graph``, which loads the inventory the
way ansible-playbook does and prints only names, so ``list`` less ``graph`` is
what printing the variables costs. Each run records its wall clock and the CPU
time (user + system) of the ansible-inventory process: on a machine shared with
other work the CPU time is the steadier of the two.

Writes benchmarks/results/inventory.json (the text, inventory.md, is written
from it by hand).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECORDED = REPO / "tests" / "inventory" / "recorded"
RESULTS = REPO / "benchmarks" / "results"
BIN = Path(sys.executable).parent
TOKEN = "bench-token"
GPUS = 4
MODELS = 8


def load(name: str) -> dict:
    return json.loads((RECORDED / f"{name}.json").read_text())


def fleet_documents(n: int) -> dict[str, bytes]:
    nodes_doc, replicas_doc, catalog = load("nodes"), load("replicas"), load("catalog")
    node_t = nodes_doc["nodes"][0]
    rep_t = next(r for r in replicas_doc["replicas"] if r["state"] == "ready")
    gpu_t = node_t["gpus"][0]
    nodes, replicas = [], []
    for i in range(n):
        node_id = f"gpu{i:05d}"
        node = copy.deepcopy(node_t)
        node.update(node_id=node_id, address=f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}",
                    gpus_total=GPUS, gpus_free=0)
        node["gpus"] = []
        for g in range(GPUS):
            model = f"model-{(i * GPUS + g) % MODELS}"
            rid = f"{model}.sim.{i * GPUS + g}-{i:05x}{g}"
            sid = f"{rid}/r0"
            node["gpus"].append({**gpu_t, "index": g, "uuid": f"GPU-{node_id}-{g}", "shard": sid})
            r = copy.deepcopy(rep_t)
            r.update(replica_id=rid, model=model, profile="sim", slot=i * GPUS + g,
                     endpoint=f"http://{node['address']}:{20000 + g}")
            s = r["shards"][0]
            s.update(shard_id=sid, node_id=node_id, gpus=[g], port=20000 + g, pid=100000 + g,
                     address=node["address"])
            s["process"] = {**(s.get("process") or {}), "pid": 100000 + g}
            r["shards"] = [s]
            replicas.append(r)
        node["hardware"] = {**node["hardware"], "node_id": node_id, "gpus": [
            {k: v for k, v in gg.items() if k != "shard"} for gg in node["gpus"]]}
        nodes.append(node)
    per_model = n * GPUS // MODELS
    catalog = {**catalog,
               "models": [{**catalog["models"][0], "name": f"model-{m}", "source": f"org/model-{m}"} for m in range(MODELS)],
               "deployments": [{"model": f"model-{m}", "profile": "sim", "replicas": per_model} for m in range(MODELS)]}
    return {"/v1/nodes": json.dumps({"nodes": nodes, "fleet": nodes_doc["fleet"]}).encode(),
            "/v1/replicas": json.dumps({"replicas": replicas, "unplaced": [], "stopping_unrecognised": []}).encode(),
            "/v1/catalog": json.dumps(catalog).encode()}


def serve(docs: dict[str, bytes]) -> tuple[ThreadingHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802
            path = self.path.split("?", 1)[0]  # the whole list whatever the page asked, as before pages
            ok = self.headers.get("Authorization") == f"Bearer {TOKEN}" and path in docs
            body = docs[path] if ok else b'{"error": "no"}'
            self.send_response(200 if ok else 403)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


MODES = {"list": ["--list"], "export": ["--list", "--export"], "graph": ["--graph"]}


def cpu_of_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_once(config: Path, tmp: Path, mode: str) -> tuple[float, float, bytes]:
    """Wall clock and CPU seconds of one ansible-inventory run, and what it printed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "LLMGW_"))}
    env.update(ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED="true",
               ANSIBLE_LOCAL_TEMP=str(tmp / "ansible-tmp"), LLMGW_TOKEN=TOKEN)
    cpu0, t0 = cpu_of_children(), time.perf_counter()
    res = subprocess.run([str(BIN / "ansible-inventory"), *MODES[mode], "-i", str(config)], cwd=REPO, env=env,
                         capture_output=True, timeout=600)
    elapsed, cpu = time.perf_counter() - t0, cpu_of_children() - cpu0
    if res.returncode != 0:
        raise SystemExit(f"ansible-inventory failed: {res.stderr.decode()[-2000:]}")
    return elapsed, cpu, res.stdout


def check(out: bytes, mode: str, n: int) -> None:
    """The output holds every node (and, for the --list modes, every shard)."""
    if mode == "graph":
        hosts = set(re.findall(rb"--(gpu\d{5})$", out, re.M))
        assert b"--@llmgw_live:" in out and len(hosts) == n, len(hosts)
        return
    hv = json.loads(out)["_meta"]["hostvars"]
    shards = sum(len(v["llmgw_live_shards"]) for v in hv.values())
    assert len(hv) == n and shards == n * GPUS, (len(hv), shards)


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 10000])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["list", "export", "graph"])
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="a plugin option for the configuration file (e.g. gpu_detail=full)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    options = dict(o.split("=", 1) for o in args.option)
    rows = []
    startup = {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for n in [1, *args.sizes]:  # 1 node: the process start-up alone
            docs = fleet_documents(n)
            server, url = serve(docs)
            try:
                config = tmp / f"bench{n}.llmgw.yml"
                config.write_text(json.dumps({"plugin": "llmgw.fleet.llmgw", "url": url, **options}))
                for mode in args.modes:
                    walls, cpus = [], []
                    for _ in range(args.runs):
                        wall, cpu, out = run_once(config, tmp, mode)
                        walls.append(wall)
                        cpus.append(cpu)
                    check(out, mode, n)
                    if n == 1:
                        startup[mode] = {"median_s": median(walls), "cpu_median_s": median(cpus)}
                        continue
                    row = {"mode": mode, "nodes": n, "shards": n * GPUS, "runs": walls, "cpu_runs": cpus,
                           "median_s": median(walls), "cpu_median_s": median(cpus),
                           "api_bytes": sum(len(b) for b in docs.values()), "output_bytes": len(out)}
                    row["per_1k_nodes_s"] = round((row["median_s"] - startup[mode]["median_s"]) / n * 1000, 3)
                    row["cpu_per_1k_nodes_s"] = round((row["cpu_median_s"] - startup[mode]["cpu_median_s"]) / n * 1000, 3)
                    rows.append(row)
                    print(f"{mode:>6} {n:>6} nodes: median {row['median_s']:.2f}s wall, {row['cpu_median_s']:.2f}s CPU "
                          f"(wall {', '.join(f'{t:.2f}' for t in walls)}), output {len(out) / 1e6:.1f} MB", flush=True)
            finally:
                server.shutdown()
                server.server_close()
    doc = {
        "what": "ansible-inventory -i X.llmgw.yml (--list, --list --export, --graph): wall clock and CPU time, median of runs",
        "plugin_options": options,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_average_before": [round(x, 2) for x in load_before],
                    "load_average_after": [round(x, 2) for x in os.getloadavg()]},
        "ansible_core": subprocess.run([str(BIN / "ansible"), "--version"], capture_output=True, text=True).stdout.splitlines()[0],
        "startup_1_node": startup,
        "rows": rows,
    }
    print(json.dumps(doc, indent=1))
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "inventory.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
