"""The control plane at fleet size: 1,000, 5,000 and 10,000 simulated 8-GPU nodes.

    .venv/bin/python benchmarks/fleet/run.py [--sizes 1000 5000 10000] [--procs 2]
        [--steady 60] [--phases cold steady reads storm partitions placement] [--no-write]
        [--update [--note TEXT]]

For each size, one real ``llmgw server`` (its own process: CPU and memory are
read from /proc/<pid> alone) and ``llmgw-fleet-sim`` with that many agents on
the real protocol (mutual TLS, the agent's own stream client and supervisor),
with deployments filling about 80 % of the GPUs with TP 1/2/4/8 replicas and
some two-node replicas on InfiniBand fabrics:

- cold: the control plane starts, the agents dial: time until every node is
  registered and every replica Ready, and the control plane's CPU for it
  (``startup_grace`` is 15 s here: a fresh fleet waits for it by design);
- steady: ``--steady`` seconds at the default heartbeat interval: the
  control plane's share of one core, its resident memory per node, and the
  simulator's share apart;
- reads: ``llmgw ctl nodes -o json`` and ``ctl replicas -o json``, 8 router
  watchers on ``/v1/router/endpoints``, ``ansible-inventory --list`` and
  ``--graph`` through ``llmgw.fleet.llmgw`` against this control plane,
  beside ``ansible-inventory --list`` over as many bare hosts, and
  ``playbooks/drift.yml`` with a declaration of the same nodes (it must find
  no drift);
- storm: SIGKILL the control plane and start it again (default startup
  grace): time until every agent has re-registered and every replica is
  Ready; replicas restarted or moved, nodes lost, GPUs assigned twice;
- partitions (``lost_after`` 60 s): 60 % of agents silent past it (nothing
  lost or moved, all back on heal), then 5 % silent (those nodes lost, their
  replicas placed again, no faster than ``replacements_per_minute``);
- stall: the control plane stopped (SIGSTOP) for ``--stall`` seconds, as a
  long GC pass or VM steal would stop it: streams dropped (registrations
  again), nodes unreachable or lost, replicas moved;
- placement: decisions per second of the reconciler's placement over the
  same inventory, in this process.

``--cpu-share 0.5`` holds the control plane to half of one CPU for the whole
run (``llmgw.sim.fleet.throttle``: a SIGSTOP/SIGCONT duty cycle, no cgroups),
as on a host where other work takes the rest; cold and storm then show what
admission control makes of the load (registrations per node, refusals).

Writes benchmarks/results/fleet.json and fleet.md (targets at 10,000 nodes,
and each figure's cost per node at the largest size over the smallest).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]  # harness, tests.support

from harness import Fleet, catalog, declared_inventory, until  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
BIN = Path(sys.executable).parent
LIFECYCLE = {"startup_grace": 15}  # defaults otherwise: heartbeat 5 s, unreachable 30 s, lost 120 s


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def wait_converged(f: Fleet, timeout: float) -> dict[str, Any]:
    """Poll /v1/summary until the fleet is whole; times of each milestone from now."""
    t0 = time.monotonic()
    out: dict[str, Any] = {}
    last = ""

    def check() -> bool:
        nonlocal last
        try:
            s = f.summary()
        except Exception as e:  # the control plane may still be starting or busy
            last = f"summary failed: {e}"
            return False
        now = round(time.monotonic() - t0, 2)
        if "registered_s" not in out and s["nodes"]["total"] == f.nodes and s["nodes"]["connected"] == f.nodes:
            out["registered_s"] = now
        last = json.dumps({k: s[k] for k in ("nodes", "replicas", "gpus")})
        if f.converged(s):
            out["ready_s"] = now
            out["summary"] = s
            return True
        return False

    try:
        until(check, "every node registered and every replica Ready", timeout, 1.0)
    except TimeoutError:
        out["timed_out"] = True
        out["last"] = last
    return out


# ---------------------------------------------------------------- phases

def cold(f: Fleet, timeout: float) -> dict[str, Any]:
    t0 = time.monotonic()
    f.start_server()
    cpu0 = f.server_cpu()
    f.start_sim()
    got = wait_converged(f, timeout)
    elapsed = time.monotonic() - t0
    got.update(wall_s=round(elapsed, 1), from_start_registered_s=None if "registered_s" not in got else
               round(got["registered_s"] + (elapsed - got.get("ready_s", elapsed)), 1),
               cp_cpu_s=round(f.server_cpu() - cpu0, 2), cp_rss_mib=round(f.server_rss() / 2**20, 1),
               sim_cpu_s=round(f.sim_cpu(), 2))
    got["to_ready_s"] = round(elapsed, 1) if "ready_s" in got else None
    st = f.sim_status()
    got.update(registrations_per_node=st.get("registrations_per_node"), refusals=st.get("refusals"),
               connect_errors=st.get("connect_errors"))
    return got


def stall(f: Fleet, seconds: float) -> dict[str, Any]:
    """SIGSTOP the control plane for ``seconds``; what it cost once it runs again."""
    import signal

    assert f.server is not None
    before, regs = f.placements(), f.sim_status().get("registrations", 0)
    f.server.send_signal(signal.SIGSTOP)
    time.sleep(seconds)
    f.server.send_signal(signal.SIGCONT)
    time.sleep(3 * 5.0)  # three default heartbeats: room for what the pause set off
    got = wait_converged(f, 300)
    s = got.get("summary") or f.summary()
    after = f.placements()
    return {"seconds": seconds, "reregistrations": f.sim_status().get("registrations", 0) - regs,
            "nodes_unreachable": s["nodes"]["by_state"].get("unreachable", 0),
            "nodes_lost": s["nodes"]["by_state"].get("lost", 0),
            "replicas_moved_or_restarted": sum(1 for rid, where in before.items() if after.get(rid) != where),
            "converged_s": got.get("ready_s")}


def steady(f: Fleet, seconds: float) -> dict[str, Any]:
    c0, s0, t0 = f.server_cpu(), f.sim_cpu(), time.monotonic()
    rss = []
    while time.monotonic() - t0 < seconds:
        time.sleep(min(5.0, seconds - (time.monotonic() - t0)) if seconds > 0 else 0)
        rss.append(f.server_rss())
    wall = time.monotonic() - t0
    cpu = f.server_cpu() - c0
    return {"seconds": round(wall, 1), "cp_cpu_share": round(cpu / wall, 4), "cp_cpu_s": round(cpu, 2),
            "cp_rss_mib": round(max(rss) / 2**20, 1), "cp_rss_kib_per_node": round(max(rss) / 1024 / f.nodes, 1),
            "sim_cpu_share": round((f.sim_cpu() - s0) / wall, 4)}


def _timed(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> dict[str, Any]:
    """Wall clock and the child's CPU (user + system) of one command."""
    before = os.times()
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wall = time.monotonic() - t0
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "rc": p.returncode, "bytes": len(p.stdout),
            **({"stderr": p.stderr.decode(errors="replace")[-2000:]} if p.returncode else {})}


def reads(f: Fleet, work: Path) -> dict[str, Any]:
    env = {**os.environ, "LLMGW_URL": f.url, "LLMGW_CA": str(f.ca.cert_path), "LLMGW_CERT": str(f.admin_pair[0]),
           "LLMGW_KEY": str(f.admin_pair[1])}
    out: dict[str, Any] = {}
    cpu0 = f.server_cpu()
    for what in ("nodes", "replicas"):
        out[f"ctl_{what}_json"] = _timed([str(BIN / "llmgw"), "ctl", what, "-o", "json"], env)
    out["cp_cpu_s_for_ctl"] = round(f.server_cpu() - cpu0, 2)
    out["router_watch_8"] = watchers(f, 8)
    # ansible-inventory through the plugin against this control plane, and over bare hosts
    src = work / "llmgw.yml"
    src.write_text(f"plugin: llmgw.fleet.llmgw\nurl: {f.url}\nca_path: {f.ca.cert_path}\n"
                   f"client_cert: {f.admin_pair[0]}\nclient_key: {f.admin_pair[1]}\n")
    bare = work / "bare.yml"
    bare.write_text("all:\n  hosts:\n" + "".join(f"    sim-{i:05d}:\n" for i in range(f.nodes)))
    aenv = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_INVENTORY_CACHE": "false"}
    inv = str(BIN / "ansible-inventory")
    out["inventory_list"] = _timed([inv, "-i", str(src), "--list"], aenv, REPO)
    out["inventory_graph"] = _timed([inv, "-i", str(src), "--graph"], aenv, REPO)
    out["inventory_list_bare_hosts"] = _timed([inv, "-i", str(bare), "--list"], aenv, REPO)
    # drift.yml as an operator runs it: a declaration of the same nodes and deployments beside the plugin
    declared = work / "declared.json"
    declared.write_text(json.dumps(declared_inventory(f.get("/v1/nodes")["nodes"], f.get("/v1/catalog"))))
    report = work / "drift.json"
    out["drift"] = _timed([str(BIN / "ansible-playbook"), "-i", str(declared), "-i", str(src),
                           str(REPO / "playbooks" / "drift.yml"), "-e", "drift_format=json", "-e", f"drift_report={report}"],
                          {**aenv, "ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED": "true"}, REPO)
    if report.exists():
        out["drift"]["summary"] = json.loads(report.read_text())["summary"]
    return out


def watchers(f: Fleet, n: int) -> dict[str, Any]:
    """``n`` routers asking for the endpoint table at once (the first answer of a watch)."""
    times: list[float] = []
    sizes: list[int] = []
    errors: list[str] = []

    def one() -> None:
        import httpx

        from llmgw.tls.context import client_context

        ctx = client_context(f.ca.cert_path, *f.admin_pair)
        t0 = time.monotonic()
        try:
            with httpx.Client(base_url=f.url, verify=ctx, timeout=120) as c:
                r = c.get("/v1/router/endpoints")
                r.raise_for_status()
                sizes.append(len(r.json().get("endpoints", [])))
        except Exception as e:
            errors.append(str(e))
            return
        times.append(time.monotonic() - t0)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"watchers": n, "max_s": round(max(times), 2) if times else None,
            "median_s": round(statistics.median(times), 2) if times else None,
            "endpoints": sizes[0] if sizes else None, "errors": errors[:3]}


def storm(f: Fleet, timeout: float) -> dict[str, Any]:
    before = f.placements()
    f.write_config()  # the default startup grace: agents must all be back before anything is placed anew
    f.kill_server()
    t0 = time.monotonic()
    f.start_server()
    cpu0 = f.server_cpu()
    got = wait_converged(f, timeout)
    after = f.placements()
    same = sum(1 for rid, where in before.items() if after.get(rid) == where)
    moved = sum(1 for rid, where in before.items() if rid in after and after[rid] != where)
    s = got.get("summary") or f.summary()
    got.update(to_converged_s=round(time.monotonic() - t0, 1), cp_cpu_s=round(f.server_cpu() - cpu0, 2),
               replicas_before=len(before), replicas_kept=same, replicas_moved=moved,
               replicas_restarted=len(before) - same - moved, replicas_new=len(set(after) - set(before)),
               nodes_lost=s["nodes"]["by_state"].get("lost", 0), gpus_twice=s["gpus"]["claimed_twice"],
               registrations_per_node=f.sim_status().get("registrations_per_node"))
    got.pop("summary", None)
    return got


def partitions(f: Fleet, lost_after: float = 60.0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    f.write_config(lost_after=lost_after, startup_grace=15)
    r = f.http().post("/v1/reload")
    r.raise_for_status()
    before = f.placements()
    # 60 %: the fault is almost certainly on the control plane's side; nothing may be lost or moved.
    silenced = f.sim_command("silence 0.6")
    t0 = time.monotonic()
    worst_lost = 0
    while time.monotonic() - t0 < 30 + lost_after + 30:
        s = f.summary()
        worst_lost = max(worst_lost, s["nodes"]["by_state"].get("lost", 0))
        time.sleep(2)
    s = f.summary()
    after = f.placements()
    out["silent_60pct"] = {"silenced": len(silenced.get("nodes", silenced.get("applied", [])) or []),
                           "held_s": round(time.monotonic() - t0, 1), "damped": s["fleet"]["damped"],
                           "nodes_lost_max": worst_lost, "replicas_moved": sum(1 for k, v in before.items()
                                                                               if after.get(k) != v)}
    f.sim_command("heal")
    t1 = time.monotonic()
    back = wait_converged(f, 600)
    out["silent_60pct"]["back_after_heal_s"] = round(time.monotonic() - t1, 1) if "ready_s" in back else None
    # 5 %: those nodes are lost and their replicas placed again, at the configured rate.
    before = f.placements()
    f.sim_command("silence 0.05")
    t2, wall2 = time.monotonic(), time.time()
    lost_at = None
    samples = []
    while time.monotonic() - t2 < 30 + lost_after + 90:
        s = f.summary()
        lost = s["nodes"]["by_state"].get("lost", 0)
        if lost and lost_at is None:
            lost_at = time.monotonic() - t2
        samples.append((time.monotonic() - t2, lost, s["replicas"]["by_state"].get("ready", 0)))
        time.sleep(2)
    after = f.placements()
    replaced = len(set(after) - set(before))
    placed_at = placements_logged(f.root / "server.log", since=wall2)
    out["silent_5pct"] = {"nodes_lost": samples[-1][1], "first_lost_after_s": None if lost_at is None else round(lost_at, 1),
                          "replicas_replaced": replaced, "observed_s": round(time.monotonic() - t2, 1),
                          "max_replaced_in_any_60s": max_in_any_minute(placed_at),
                          "replacements_per_minute_setting": 10}
    f.sim_command("heal")
    return out


# A pass's "placed" lines are logged once the pass has decided everything, so a
# line's time lags its decision by up to the pass's length (half a second when
# 250 nodes are lost at once at 5,000 nodes); the limiter counts decision times.
LOG_LAG_S = 1.0


def max_in_any_minute(placed_at: list[float]) -> int:
    """Most placements logged within 60 s less ``LOG_LAG_S`` of one another: the bound
    ``replacements_per_minute`` sets, read from log times. A limiter that let a whole
    minute's worth through twice in a minute (a refilled token bucket) still shows."""
    return max((sum(1 for u in placed_at if t <= u < t + 60 - LOG_LAG_S) for t in placed_at), default=0)


def placements_logged(log_path: Path, since: float) -> list[float]:
    """When the control plane placed a replica (its log's "placed" lines), as epoch seconds after ``since``."""
    import datetime as dt

    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        if ": placed (" not in line:
            continue
        try:
            t = dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        except ValueError:
            continue
        if t >= since:
            out.append(t)
    return out


def placement_rate(nodes: int) -> dict[str, Any]:
    """The reconciler's placement over ``nodes`` simulated inventories: every declared replica, one decision each."""
    from llmgw.controlplane.capacity import FleetCapacity
    from llmgw.controlplane.lifecycle import NodeState
    from llmgw.controlplane.reconciler import NodeView, placement_request
    from llmgw.placement.shape import node_key
    from llmgw.settings import parse_server_settings
    from llmgw.sim.fleet.hardware import DEFAULT_MIX, allocate, load_templates, node_inventory, parse_mix

    templates = load_templates()
    names = allocate(parse_mix(DEFAULT_MIX, list(templates)), nodes)
    views = {}
    for i, name in enumerate(names):
        nid = f"sim-{i:05d}"
        inv = node_inventory(templates[name], nid, i)
        views[nid] = NodeView(nid, NodeState.READY, True, 1, inv, "127.0.0.1", node_key(inv))
    settings = parse_server_settings({"api": {"listen": {"port": 1}}, "insecure_no_tls": True, **catalog(nodes)})
    cat = settings.catalog
    t0 = time.process_time()
    fleet = FleetCapacity.of({}, views)
    build = time.process_time() - t0
    decisions = placed = 0
    t1 = time.process_time()
    for dep in cat.deployments:
        req = placement_request(cat, dep, settings.memory_headroom)
        for _ in range(dep.replicas):
            res = fleet.place(req)
            decisions += 1
            if res.placement is not None:
                placed += 1
                fleet.take(res.placement)
    spent = time.process_time() - t1
    return {"nodes": nodes, "decisions": decisions, "placed": placed, "cpu_s": round(spent, 3),
            "decisions_per_s": round(decisions / spent), "index_build_cpu_s": round(build, 3)}


# ---------------------------------------------------------------- driver

def run_size(n: int, args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"nodes": n, "desired_replicas": sum(d["replicas"] for d in catalog(n)["deployments"])}
    if "placement" in args.phases:
        log(f"{n}: placement rate")
        res["placement"] = placement_rate(n)
    live = [p for p in args.phases if p != "placement"]
    if not live:
        return res
    with tempfile.TemporaryDirectory(prefix=f"llmgw-fleet-{n}-") as tmp:
        f = Fleet(Path(tmp), n, procs=args.procs, lifecycle=dict(LIFECYCLE), cpu_share=args.cpu_share)
        try:
            log(f"{n}: cold start")
            came_up = cold(f, args.timeout)  # every live phase needs the fleet up; kept when asked for
            if "cold" in live:
                res["cold"] = came_up
            log(f"{n}: cold {came_up}")
            if "steady" in live:
                res["steady"] = steady(f, args.steady)
                log(f"{n}: steady {res['steady']}")
            if "reads" in live:
                res["reads"] = reads(f, Path(tmp))
                log(f"{n}: reads {res['reads']}")
            if "stall" in live:
                res["stall"] = stall(f, args.stall)
                log(f"{n}: stall {res['stall']}")
            if "storm" in live:
                f.lifecycle = {}
                res["storm"] = storm(f, args.timeout)
                log(f"{n}: storm {res['storm']}")
            if "partitions" in live:
                res["partitions"] = partitions(f)
                log(f"{n}: partitions {res['partitions']}")
        finally:
            f.stop()
            if args.keep_logs:
                for name in ("server.log", "sim.log"):
                    src = Path(tmp) / name
                    if src.exists():
                        (Path(args.keep_logs) / f"{n}-{name}").write_bytes(src.read_bytes())
    return res


def per_node(res: dict[str, Any], path: tuple[str, ...]) -> float | None:
    v: Any = res
    for k in path:
        if not isinstance(v, dict) or k not in v or v[k] is None:
            return None
        v = v[k]
    return float(v) / res["nodes"]


LINEAR = {
    "cold start, control-plane CPU": ("cold", "cp_cpu_s"),
    "cold start, time to Ready": ("cold", "to_ready_s"),
    "steady state, control-plane CPU": ("steady", "cp_cpu_share"),
    "steady state, resident memory": ("steady", "cp_rss_mib"),
    "registration storm, control-plane CPU": ("storm", "cp_cpu_s"),
    "registration storm, time to converge": ("storm", "to_converged_s"),
    "ctl replicas -o json": ("reads", "ctl_replicas_json", "wall_s"),
    "ansible-inventory --list, CPU": ("reads", "inventory_list", "cpu_s"),
    "ansible-inventory --graph, CPU": ("reads", "inventory_graph", "cpu_s"),
    "drift.yml, CPU": ("reads", "drift", "cpu_s"),
}


def targets(big: dict[str, Any]) -> list[tuple[str, str, str, Any]]:
    def g(*path: str) -> Any:
        v: Any = big
        for k in path:
            v = v.get(k) if isinstance(v, dict) else None
        return v

    storm_zero = [g("storm", k) for k in ("replicas_moved", "replicas_restarted", "nodes_lost", "gpus_twice")]
    rows = [
        ("control plane steady state, share of one core", "≤ 0.25", g("steady", "cp_cpu_share"),
         (g("steady", "cp_cpu_share") or 9) <= 0.25),
        ("control plane resident memory per node", "≤ 100 KiB", g("steady", "cp_rss_kib_per_node"),
         (g("steady", "cp_rss_kib_per_node") or 1e9) <= 100),
        ("registration storm converged", "≤ 60 s", g("storm", "to_converged_s"),
         (g("storm", "to_converged_s") or 1e9) <= 60),
        ("storm: replicas moved / restarted, nodes lost, GPUs twice", "0 / 0 / 0 / 0",
         " / ".join(str(x) for x in storm_zero), all(x == 0 for x in storm_zero)),
        ("cold start to every replica Ready", "≤ 120 s", g("cold", "to_ready_s"), (g("cold", "to_ready_s") or 1e9) <= 120),
        ("pure placement", "≥ 10,000 decisions/s", g("placement", "decisions_per_s"),
         (g("placement", "decisions_per_s") or 0) >= 10000),
        ("ctl replicas -o json", "≤ 2 s", g("reads", "ctl_replicas_json", "wall_s"),
         (g("reads", "ctl_replicas_json", "wall_s") or 1e9) <= 2),
        ("ansible-inventory --graph (CPU)", "≤ 5 s", g("reads", "inventory_graph", "cpu_s"),
         (g("reads", "inventory_graph", "cpu_s") or 1e9) <= 5),
        ("ansible-inventory --list (CPU)", "≤ 15 s", g("reads", "inventory_list", "cpu_s"),
         (g("reads", "inventory_list", "cpu_s") or 1e9) <= 15),
        ("beside it: ansible-inventory --list over as many bare hosts (ansible-core's floor, CPU)", "reported",
         g("reads", "inventory_list_bare_hosts", "cpu_s"), None),
        ("playbooks/drift.yml, no drift found (CPU)", "≤ 60 s", g("reads", "drift", "cpu_s"),
         g("reads", "drift", "rc") == 0 and (g("reads", "drift", "cpu_s") or 1e9) <= 60),
        ("partitions 60 %: nodes lost, replicas moved", "0, 0",
         f"{g('partitions', 'silent_60pct', 'nodes_lost_max')}, {g('partitions', 'silent_60pct', 'replicas_moved')}",
         g("partitions", "silent_60pct", "nodes_lost_max") == 0 and g("partitions", "silent_60pct", "replicas_moved") == 0),
        ("partitions 5 %: nodes lost, most replicas re-placed in any 60 s", "500, ≤ replacements_per_minute (10)",
         f"{g('partitions', 'silent_5pct', 'nodes_lost')}, {g('partitions', 'silent_5pct', 'max_replaced_in_any_60s')}",
         g("partitions", "silent_5pct", "nodes_lost") == big["nodes"] // 20
         and 0 < (g("partitions", "silent_5pct", "max_replaced_in_any_60s") or 0) <= 10),
    ]
    return [(name, want, got, "n/a" if ok is None else "yes" if ok else "no") for name, want, got, ok in rows]


def markdown(doc: dict[str, Any]) -> str:
    sizes = doc["sizes"]
    big, small = sizes[-1], sizes[0]
    out = ["# Control plane at fleet size", "",
           f"`python benchmarks/fleet/run.py` ({doc['when']}, {doc['machine']}). One `llmgw server` process and "
           f"`llmgw-fleet-sim` with N simulated 8-GPU agents on the real protocol (mutual TLS, the agent's own "
           f"stream client and supervisor) in {doc['procs']} worker processes, on the same 2-core machine. "
           "The control plane's CPU and memory are read from /proc for its own process; the simulator's are "
           "reported apart. Deployments fill about 80 % of the GPUs with TP 1/2/4/8 replicas and two-node "
           "replicas on InfiniBand fabrics. Cold start uses `startup_grace` 15 s (a fresh fleet waits for it by "
           "design); the storm restarts the control plane with the default 120 s; the partitions use "
           "`lost_after` 60 s. Everything else is the default (heartbeat 5 s, keepalive 10 s).", "",
           *([doc["note"], ""] if doc.get("note") else []),
           f"## Targets at {big['nodes']:,} nodes", "", "| figure | target | measured | met |", "|---|---|---|---|"]
    for name, want, got, ok in targets(big):
        out.append(f"| {name} | {want} | {got} | {ok} |")
    out += ["", f"## Linearity: cost per node at {big['nodes']:,} over cost per node at {small['nodes']:,} (target ≤ 1.3)",
            "", "| figure | ratio |", "|---|---|"]
    for name, path in LINEAR.items():
        a, b = per_node(big, path), per_node(small, path)
        out.append(f"| {name} | {'n/a' if a is None or not b else f'{a / b:.2f}'} |")
    if "placement" in big and "placement" in small:
        a = 1 / big["placement"]["decisions_per_s"]
        b = 1 / small["placement"]["decisions_per_s"]
        out.append(f"| placement, CPU per decision | {a / b:.2f} |")
    for u in doc.get("updated", []):
        out.append(f"Phases {', '.join(u['phases'])} at {', '.join(map(str, u['sizes']))} nodes measured again "
                   f"{u['when']}" + (f": {u['note']}" if u.get("note") else ", after the change noted in the results' history."))
        out.append("")
    out += ["", "## Every size", "", "```json", json.dumps(sizes, indent=1), "```", ""]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 10000])
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--steady", type=float, default=60.0)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--stall", type=float, default=30.0, help="seconds the stall phase stops the control plane")
    ap.add_argument("--cpu-share", type=float, default=None,
                    help="hold the control plane to this share of one CPU for the whole run (contention)")
    ap.add_argument("--phases", nargs="+", default=["placement", "cold", "steady", "reads", "storm", "partitions"],
                    choices=["placement", "cold", "steady", "reads", "stall", "storm", "partitions"])
    ap.add_argument("--keep-logs", default=None, help="copy each size's server and simulator logs here")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--update", action="store_true",
                    help="merge the phases measured now into the existing results (same sizes), keeping the rest")
    ap.add_argument("--note", default=None, help="what changed since the last measurement, for the results")
    args = ap.parse_args()
    doc = {"when": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{os.cpu_count()} CPUs, {platform.python_version()}",
           "procs": args.procs, "sizes": [], **({"note": args.note} if args.note and not args.update else {})}
    for n in args.sizes:
        doc["sizes"].append(run_size(n, args))
    print(json.dumps(doc, indent=1))
    if args.update and (RESULTS / "fleet.json").exists():
        old = json.loads((RESULTS / "fleet.json").read_text())
        fresh = {r["nodes"]: r for r in doc["sizes"]}
        for r in old["sizes"]:
            r.update(fresh.pop(r["nodes"], {}))
        old["sizes"] = sorted(old["sizes"] + list(fresh.values()), key=lambda r: r["nodes"])
        old.setdefault("updated", []).append({"when": doc["when"], "phases": args.phases,
                                              "sizes": [r["nodes"] for r in doc["sizes"]],
                                              **({"note": args.note} if args.note else {})})
        doc = old
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "fleet.json").write_text(json.dumps(doc, indent=1) + "\n")
        (RESULTS / "fleet.md").write_text(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
