"""The control plane at fleet size: 1,000, 5,000 and 10,000 simulated 8-GPU nodes.

    .venv/bin/python benchmarks/fleet/run.py [--sizes 1000 5000 10000] [--procs 2]
        [--steady 60] [--phases placement cold steady reads stall storm partitions contention failover]
        [--stall 10 30] [--contention-share 0.5] [--lease-ttl 10] [--no-write | --out PATH]
        [--update [--note TEXT]] [--keep-logs DIR]
    .venv/bin/python benchmarks/fleet/run.py --quick --out /tmp/fleet   # the short form CI runs

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
- stall: the control plane stopped (SIGSTOP) for each of ``--stall``
  seconds in turn, as a long GC pass or VM steal would stop it: streams
  closed and nodes judged unreachable or lost (from its log), registrations
  again (the simulator's count), replicas moved;
- contention: a fleet of its own with the control plane held to
  ``--contention-share`` of one core from its start: cold start and a storm,
  converged or not, registrations per node, the agents' connect errors and
  refusals;
- failover: a fleet of its own with two control planes on one etcd member
  (``ha``, ``--lease-ttl``), the agents knowing both: SIGKILL the leader;
  time until the standby leads, until every node is registered with it and
  every replica Ready, registrations per node, replicas moved or restarted;
- placement: decisions per second of the reconciler's placement over the
  same inventory, in this process.

``--cpu-share 0.5`` holds the control plane to half of one CPU for the whole
run (``llmgw.sim.fleet.throttle``: a SIGSTOP/SIGCONT duty cycle, no cgroups),
as on a host where other work takes the rest; cold and storm then show what
admission control makes of the load (registrations per node, refusals).

Writes benchmarks/results/fleet.json and fleet.md (targets at 10,000 nodes,
each figure's cost per node at the largest size over the smallest, the stall,
overload and failover figures of every size with the machine's load average
beside them, and a yardstick of this machine's CPU speed, the placement rate
over 1,000 nodes, so figures from two machines can be read together).
``--quick`` (40 nodes, a 3 s stall, a 3 s lease) exercises every new phase in
about a minute and writes only ``--out``; tests/integration/test_fleet_bench_quick.py
runs it.
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
from llmgw.durable import write_atomic  # noqa: E402

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
        if f.server is not None and f.server.poll() is not None:
            raise ServerExited(f.server.returncode)
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
    except ServerExited as e:
        out["server_exited"] = e.returncode
        out["last"] = last
    return out


class ServerExited(Exception):
    """The control plane being waited on exited (a leader that stepped down exits with status 3)."""

    def __init__(self, returncode: int):
        super().__init__(f"the control plane exited with status {returncode}")
        self.returncode = returncode


# ---------------------------------------------------------------- phases

def cold(f: Fleet, timeout: float) -> dict[str, Any]:
    """The control plane started with every agent ready to dial, to every replica Ready.

    The simulator builds its agents first (each node's certificate and TLS context, 1-2 ms
    of CPU a node) and holds them: agents make that start on machines of their own, and timed
    here it put 12-15 s of the simulator's CPU on the control plane's two cores before its
    first registration at 10,000 nodes. The clock starts with the control plane."""
    f.start_sim(hold=True)
    sim0 = f.sim_cpu(fresh=True)
    t0 = time.monotonic()
    f.start_server()
    cpu0 = f.server_cpu()
    f.go()
    got = wait_converged(f, timeout)
    elapsed = time.monotonic() - t0
    got.update(wall_s=round(elapsed, 1), from_start_registered_s=None if "registered_s" not in got else
               round(got["registered_s"] + (elapsed - got.get("ready_s", elapsed)), 1),
               cp_cpu_s=round(f.server_cpu() - cpu0, 2), cp_rss_mib=round(f.server_rss() / 2**20, 1),
               sim_cpu_s=round(f.sim_cpu() - sim0, 2), sim_start_cpu_s=round(sim0, 2))
    got["to_ready_s"] = round(elapsed, 1) if "ready_s" in got else None
    st = sim_settled(f) if "ready_s" in got else f.sim_status()
    got.update(registrations_per_node=st.get("registrations_per_node"), refusals=st.get("refusals"),
               connect_errors=st.get("connect_errors"))
    return got


def log_size(f: Fleet, name: str = "server.log") -> int:
    path = f.root / name
    return path.stat().st_size if path.exists() else 0


def log_since(f: Fleet, offset: int, name: str = "server.log") -> str:
    with open(f.root / name, "rb") as fh:
        fh.seek(offset)
        return fh.read().decode(errors="replace")


def churn(text: str) -> dict[str, int]:
    """What the control plane logged of streams and nodes going away: a pause or an overload turned into churn."""
    return {"streams_closed": text.count(": stream closed ("), "nodes_unreachable": text.count(" -> unreachable ("),
            "nodes_lost_logged": text.count(" -> lost ("), "tracebacks": text.count("Traceback (most recent call last)")}


def sim_settled(f: Fleet) -> dict[str, Any]:
    """The simulator's status once it counts every agent registered: it is written every second, so
    the status read the moment the control plane converged can be a second behind."""
    try:
        return until(lambda: (st := f.sim_status()).get("registered") == f.nodes and st, "the simulator's status",
                     30, 0.2)
    except TimeoutError:
        return f.sim_status()


def stall(f: Fleet, seconds: float) -> dict[str, Any]:
    """SIGSTOP the control plane for ``seconds``; what it cost once it runs again.

    Counted from the control plane's log (streams it saw closed, nodes it judged
    unreachable or lost) and the simulator's registrations, after three
    heartbeat intervals of the control plane running again: room for what the
    pause set off to show."""
    import signal

    assert f.server is not None
    load = os.getloadavg()[0]
    heartbeat = f.summary()["fleet"]["heartbeat_interval_s"]
    before, regs, offset = f.placements(), sim_settled(f).get("registrations", 0), log_size(f)
    f.server.send_signal(signal.SIGSTOP)
    time.sleep(seconds)
    f.server.send_signal(signal.SIGCONT)
    woke = time.monotonic()
    time.sleep(3 * heartbeat)
    got = wait_converged(f, 300)
    after = f.placements()
    logged = log_since(f, offset)
    return {"seconds": seconds, **churn(logged), "reregistrations": f.sim_status().get("registrations", 0) - regs,
            "replicas_moved_or_restarted": sum(1 for rid, where in before.items() if after.get(rid) != where),
            "noticed": "stalled for" in logged, "converged_after_wake_s": round(time.monotonic() - woke, 1)
            if "ready_s" in got else None, "load_avg_1m": round(load, 2)}


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
               registrations_per_node=sim_settled(f).get("registrations_per_node"))
    got.pop("summary", None)
    return got


def mean_registrations(hist: dict[str, int] | None, nodes: int) -> float | None:
    """Registrations per node from the simulator's histogram (registrations -> nodes)."""
    if not hist:
        return None
    return round(sum(int(k) * v for k, v in hist.items()) / nodes, 3)


def contention(n: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The control plane held to ``--contention-share`` of one core from its start: cold start, then a storm.

    Its own fleet, so the share holds from the first dial; the simulator is
    not held (agents run on their own machines). What admission control makes
    of the load: converged or not, registrations per node, the refusals and
    connect errors the agents saw, the streams and nodes the control plane
    logged going away."""
    out: dict[str, Any] = {"cpu_share": args.contention_share, "load_avg_1m": round(os.getloadavg()[0], 2)}
    f = Fleet(tmp / "contention", n, procs=args.procs, lifecycle=lifecycle(args), cpu_share=args.contention_share,
              per_source_cap=args.per_source_cap)
    try:
        got = cold(f, args.contention_timeout)
        got.pop("summary", None)
        got.update(churn(log_since(f, 0)), converged="ready_s" in got,
                   registrations_mean=mean_registrations(got.get("registrations_per_node"), n))
        out["cold"] = got
        log(f"{n}: contention cold {got}")
        if got["converged"]:
            offset, regs = log_size(f), f.sim_status().get("registrations_per_node") or {}
            out["storm_load_avg_1m"] = round(os.getloadavg()[0], 2)
            f.lifecycle = {}
            st = storm(f, args.contention_timeout)
            after = st.get("registrations_per_node") or {}
            st.update(churn(log_since(f, offset)), converged="ready_s" in st,
                      registrations_mean=round((mean_registrations(after, n) or 0) - (mean_registrations(regs, n) or 0), 3))
            now_st = f.sim_status()  # the simulator counts from its start: the storm's share is the difference
            st.update({k: (now_st.get(k) or 0) - (got.get(k) or 0) for k in ("refusals", "connect_errors")})
            out["storm"] = st
            log(f"{n}: contention storm {st}")
    finally:
        f.stop()
        keep(args, f.root, n, "contention")
    return out


def failover(n: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Two control planes on one etcd; SIGKILL the leader once the fleet is whole.

    Its own fleet (the other phases run one control plane, as the quickstart
    does). Measured: the time from the kill until the standby answers as the
    leader (target: ``lease_ttl`` + 5 s), until every agent has registered
    with it and every replica is Ready again, the registrations that cost,
    and what moved or restarted (target: nothing)."""
    from harness import EtcdServer

    if EtcdServer.binary() is None:
        return {"skipped": "etcd is not installed (make etcd: Debian's etcd-server)"}
    ha = {"lease_ttl": args.lease_ttl, "renew_interval": args.renew_interval}
    out: dict[str, Any] = {**ha, "load_avg_1m": round(os.getloadavg()[0], 2)}
    f = Fleet(tmp / "failover", n, procs=args.procs, lifecycle=lifecycle(args), ha=ha, per_source_cap=args.per_source_cap)
    try:
        # The standby runs from the start, as it would in production: a leader that cannot renew
        # its lease during the cold start (its loop held by the registrations) hands over to it.
        f.write_config()
        f.start_server()
        f.lifecycle = {}  # the standby's failover grace: the default startup_grace, as in the storm
        f.write_config()
        f.start_standby()
        f.start_sim()
        t0 = time.monotonic()
        came_up = wait_converged(f, args.timeout)
        out["cold_ready_s"] = round(time.monotonic() - t0, 1) if "ready_s" in came_up else None
        if "ready_s" not in came_up:
            out["cold"] = {k: v for k, v in came_up.items() if k != "summary"}
            out["cold"]["leader_log"] = [line for line in log_since(f, 0).splitlines()
                                         if "llmgw.controlplane.leader" in line][-3:]
            return out
        # the simulator's status is written every second: read before it counts every agent, the
        # registrations before the kill came out 0 and the failover's cost twice what it was
        before, regs = f.placements(), sim_settled(f).get("registrations", 0)
        offset = log_size(f, "standby.log")
        f.kill_server()
        killed = time.monotonic()
        try:
            until(lambda: f.role(f.standby_port) == "leader", "the standby to lead", args.lease_ttl + 60, 0.05)
            out["new_leader_s"] = round(time.monotonic() - killed, 2)
        except TimeoutError:
            out["new_leader_s"] = None
            return out
        f.promote_standby()
        cpu0 = f.server_cpu()
        got = wait_converged(f, args.timeout)
        after = f.placements()
        s = got.get("summary") or f.summary()
        same = sum(1 for rid, where in before.items() if after.get(rid) == where)
        moved = sum(1 for rid, where in before.items() if rid in after and after[rid] != where)
        out.update(converged_s=round(time.monotonic() - killed, 1) if "ready_s" in got else None,
                   new_leader_cpu_s=round(f.server_cpu() - cpu0, 2),
                   registrations_mean=round((sim_settled(f).get("registrations", 0) - regs) / n, 3),
                   replicas_before=len(before), replicas_kept=same, replicas_moved=moved,
                   replicas_restarted=len(before) - same - moved, nodes_lost=s["nodes"]["by_state"].get("lost", 0),
                   gpus_twice=s["gpus"]["claimed_twice"], **churn(log_since(f, offset, "standby.log")))
        out.pop("streams_closed", None)  # the old leader's streams closed with it: by design, not churn
    finally:
        f.stop()
        keep(args, f.root, n, "failover")
    return out


def keep(args: argparse.Namespace, root: Path, n: int, phase: str = "") -> None:
    if not args.keep_logs:
        return
    Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
    for name in ("server.log", "standby.log", "sim.log"):
        src = root / name
        if src.exists():
            (Path(args.keep_logs) / f"{n}-{phase + '-' if phase else ''}{name}").write_bytes(src.read_bytes())


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

def lifecycle(args: argparse.Namespace) -> dict[str, Any]:
    return {**LIFECYCLE, "startup_grace": args.startup_grace,
            **({"heartbeat_interval": args.heartbeat} if args.heartbeat else {})}


def yardstick(runs: int = 3) -> dict[str, Any]:
    """This machine's speed at pure CPU work: placement decisions per second over 1,000 nodes
    (median of ``runs``), so figures from two machines can be read against each other."""
    rates = [placement_rate(1000)["decisions_per_s"] for _ in range(runs)]
    return {"placement_decisions_per_s_1000_nodes": round(statistics.median(rates)), "runs": rates,
            "load_avg_1m": round(os.getloadavg()[0], 2)}


SHARED = ("cold", "steady", "reads", "stall", "storm", "partitions")


def run_size(n: int, args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"nodes": n, "desired_replicas": sum(d["replicas"] for d in catalog(n)["deployments"]),
                           "per_source_cap": args.per_source_cap}
    if "placement" in args.phases:
        log(f"{n}: placement rate")
        res["placement"] = placement_rate(n)
    live = [p for p in args.phases if p in SHARED]
    with tempfile.TemporaryDirectory(prefix=f"llmgw-fleet-{n}-") as tmp:
        if live:
            f = Fleet(Path(tmp), n, procs=args.procs, lifecycle=lifecycle(args), cpu_share=args.cpu_share,
                      per_source_cap=args.per_source_cap)
            try:
                log(f"{n}: cold start")
                load = round(os.getloadavg()[0], 2)
                came_up = cold(f, args.timeout)  # every live phase needs the fleet up; kept when asked for
                came_up["load_avg_1m"] = load
                if "cold" in live:
                    res["cold"] = came_up
                log(f"{n}: cold {came_up}")
                if "steady" in live:
                    load = round(os.getloadavg()[0], 2)
                    res["steady"] = {**steady(f, args.steady), "load_avg_1m": load}
                    log(f"{n}: steady {res['steady']}")
                if "reads" in live:
                    res["reads"] = reads(f, Path(tmp))
                    log(f"{n}: reads {res['reads']}")
                if "stall" in live:
                    res["stall"] = {}
                    for seconds in args.stall:
                        res["stall"][f"{seconds:g}s"] = got = stall(f, seconds)
                        log(f"{n}: stall {got}")
                if "storm" in live:
                    f.lifecycle = {}
                    load = round(os.getloadavg()[0], 2)
                    res["storm"] = {**storm(f, args.timeout), "load_avg_1m": load}
                    log(f"{n}: storm {res['storm']}")
                if "partitions" in live:
                    res["partitions"] = partitions(f)
                    log(f"{n}: partitions {res['partitions']}")
            finally:
                f.stop()
                keep(args, Path(tmp), n)
        if "contention" in args.phases:
            log(f"{n}: contention (control plane at {args.contention_share} of a core)")
            res["contention"] = contention(n, args, Path(tmp))
        if "failover" in args.phases:
            log(f"{n}: failover")
            res["failover"] = failover(n, args, Path(tmp))
            log(f"{n}: failover {res['failover']}")
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
        ("control plane steady state, share of one core", "≤ 0.10", g("steady", "cp_cpu_share"),
         (g("steady", "cp_cpu_share") or 9) <= 0.10),
        ("control plane resident memory per node", "≤ 100 KiB", g("steady", "cp_rss_kib_per_node"),
         (g("steady", "cp_rss_kib_per_node") or 1e9) <= 100),
        ("registration storm converged", "≤ 30 s", g("storm", "to_converged_s"),
         (g("storm", "to_converged_s") or 1e9) <= 30),
        ("storm: replicas moved / restarted, nodes lost, GPUs twice", "0 / 0 / 0 / 0",
         " / ".join(str(x) for x in storm_zero), all(x == 0 for x in storm_zero)),
        ("cold start to every replica Ready", "≤ 60 s", g("cold", "to_ready_s"), (g("cold", "to_ready_s") or 1e9) <= 60),
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


def resilience(res: dict[str, Any]) -> list[tuple[str, str, Any, bool | None]]:
    """The stall, contention and failover figures of one size against their targets (issue #27)."""
    rows: list[tuple[str, str, Any, bool | None]] = []
    for key, st in (res.get("stall") or {}).items():
        zero = [st.get(k) for k in ("streams_closed", "nodes_unreachable", "replicas_moved_or_restarted")]
        rows.append((f"stall {key}: streams closed / nodes unreachable / replicas moved", "0 / 0 / 0",
                     " / ".join(map(str, zero)), all(x == 0 for x in zero)))
        rows.append((f"stall {key}: registrations again", "0", st.get("reregistrations"), st.get("reregistrations") == 0))
    c = res.get("contention")
    if c:
        share = c["cpu_share"]
        for what, target in (("cold", 60), ("storm", 30)):
            p = c.get(what)
            if p is None:
                rows.append((f"{share} core, {what}: converged", "yes", "not run (cold did not converge)", False))
                continue
            t = p.get("to_ready_s") if what == "cold" else p.get("to_converged_s")
            rows.append((f"{share} core, {what}: converged, s", f"yes, ≤ {target} s",
                         t if p.get("converged") else f"no ({p.get('timed_out') and 'timed out'})",
                         bool(p.get("converged")) and (t or 1e9) <= target))
            rows.append((f"{share} core, {what}: registrations per node", "≤ 1.1", p.get("registrations_mean"),
                         bool(p.get("converged")) and (p.get("registrations_mean") or 9) <= 1.1))
            rows.append((f"{share} core, {what}: connect errors / refusals / streams closed", "reported",
                         f"{p.get('connect_errors')} / {p.get('refusals')} / {p.get('streams_closed')}", None))
            # The duty cycle bounds wall time, not CPU: on a crowded host the control plane's running
            # windows are shared with everything else, and it gets less than the share it was held to.
            span = p.get("wall_s") if what == "cold" else p.get("to_converged_s")
            if span and p.get("cp_cpu_s") is not None:
                rows.append((f"{share} core, {what}: CPU the control plane got, share of one core",
                             f"reported (≤ {share})", round(p["cp_cpu_s"] / span, 3), None))
    fo = res.get("failover")
    if fo and "server_exited" in (fo.get("cold") or {}):
        rows.append(("failover: the leader leads through the cold start", "yes",
                     f"no: it stepped down (exit {fo['cold']['server_exited']}), its loop held past "
                     "lease_ttl - renew_interval; the standby took over", False))
    elif fo and "skipped" not in fo:
        ttl = fo["lease_ttl"]
        rows.append(("failover: SIGKILL of the leader to a new leader, s", f"≤ lease_ttl + 5 = {ttl + 5}",
                     fo.get("new_leader_s"), (fo.get("new_leader_s") or 1e9) <= ttl + 5))
        rows.append(("failover: to every node registered and replica Ready, s", "reported", fo.get("converged_s"), None))
        zero = [fo.get(k) for k in ("replicas_moved", "replicas_restarted", "nodes_lost", "gpus_twice")]
        rows.append(("failover: replicas moved / restarted, nodes lost, GPUs twice", "0 / 0 / 0 / 0",
                     " / ".join(map(str, zero)), all(x == 0 for x in zero)))
        rows.append(("failover: registrations per node", "1", fo.get("registrations_mean"),
                     fo.get("registrations_mean") is not None and fo["registrations_mean"] <= 1.1))
    elif fo:
        rows.append(("failover", "measured", fo["skipped"], None))
    return rows


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
    measured = [r for r in sizes if resilience(r)]
    if measured:
        out += ["", "## Stall, overload and failover", "",
                "Stall: the control plane SIGSTOPped in the steady fleet, counted from its log after three heartbeat "
                "intervals of running again. Overload: a fleet of its own with the control plane held to a share of "
                "one core (SIGSTOP/SIGCONT duty cycle) from its start, cold start then a storm; the simulator is not "
                "held. Failover: a fleet of its own with two control planes on one etcd member, the leader SIGKILLed. "
                "The load average beside each size is the machine's 1-minute load when the phase began.", "",
                "| nodes | figure | target | measured | met | load |", "|---|---|---|---|---|---|"]
        for r in measured:
            loads = {"stall": next((v.get("load_avg_1m") for v in (r.get("stall") or {}).values()), None),
                     "contention": (r.get("contention") or {}).get("load_avg_1m"),
                     "failover": (r.get("failover") or {}).get("load_avg_1m")}
            for name, want, got, ok in resilience(r):
                phase = "stall" if name.startswith("stall") else "failover" if name.startswith("failover") else "contention"
                out.append(f"| {r['nodes']:,} | {name} | {want} | {got} | {'n/a' if ok is None else 'yes' if ok else 'no'}"
                           f" | {loads[phase]} |")
    if doc.get("yardstick"):
        y = doc["yardstick"]
        out += ["", f"Yardstick (this machine's pure CPU speed): placement over 1,000 nodes, "
                    f"{y['placement_decisions_per_s_1000_nodes']:,} decisions/s (median of {len(y['runs'])} runs: "
                    f"{', '.join(f'{r:,}' for r in y['runs'])}; load "
                    f"{y['load_avg_1m']}). A machine with half the rate should expect about twice the CPU "
                    "figures above.", ""]
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
    ap.add_argument("--stall", type=float, nargs="+", default=[10.0, 30.0],
                    help="seconds the stall phase stops the control plane, one pause after another")
    ap.add_argument("--startup-grace", type=float, default=15.0, help="the cold start's startup_grace")
    ap.add_argument("--heartbeat", type=float, default=None, help="lifecycle.heartbeat_interval (default: the product's)")
    ap.add_argument("--contention-share", type=float, default=0.5,
                    help="the contention phase's share of one core for the control plane")
    ap.add_argument("--contention-timeout", type=float, default=420.0,
                    help="how long the contention phase waits for cold start and storm to converge")
    ap.add_argument("--lease-ttl", type=int, default=10, help="the failover phase's ha.lease_ttl")
    ap.add_argument("--renew-interval", type=float, default=2.0, help="the failover phase's ha.renew_interval")
    ap.add_argument("--quick", action="store_true",
                    help="the short form CI runs: 40 nodes, 5 s steady, 3 s stall, 1 s heartbeats, short grace and "
                         "lease; "
                         "writes only --out")
    ap.add_argument("--out", type=Path, default=None,
                    help="write OUT.json and OUT.md instead of benchmarks/results/fleet.*")
    ap.add_argument("--cpu-share", type=float, default=None,
                    help="hold the control plane to this share of one CPU for the whole run (contention)")
    ap.add_argument("--phases", nargs="+", default=["placement", "cold", "steady", "reads", "storm", "partitions"],
                    choices=["placement", "cold", "steady", "reads", "stall", "storm", "partitions", "contention", "failover"])
    ap.add_argument("--keep-logs", default=None, help="copy each size's server and simulator logs here")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--per-source-cap", type=int, default=None,
                    help="api.clients.max_connections_per_source for the control plane (default: the product's, "
                         "128). Each simulated agent dials from a loopback address of its own, so the cap binds "
                         "only where several share one (the simulator's --nodes-per-address); 0 lifts it")
    ap.add_argument("--update", action="store_true",
                    help="merge the phases measured now into the existing results (same sizes), keeping the rest")
    ap.add_argument("--note", default=None, help="what changed since the last measurement, for the results")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.steady, args.stall, args.startup_grace, args.heartbeat = [40], 5.0, [3.0], 2.0, 1.0
        args.lease_ttl, args.renew_interval, args.timeout, args.contention_timeout = 3, 0.5, 180.0, 180.0
        args.phases = ["placement", "cold", "steady", "stall", "contention", "failover"]
        args.update, args.no_write = False, args.out is None
    doc = {"when": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{os.cpu_count()} CPUs, {platform.python_version()}",
           "procs": args.procs, "sizes": [], **({"note": args.note} if args.note and not args.update else {})}
    doc["yardstick"] = yardstick()
    for n in args.sizes:
        doc["sizes"].append(run_size(n, args))
    print(json.dumps(doc, indent=1))
    if args.update and (RESULTS / "fleet.json").exists():
        old = json.loads((RESULTS / "fleet.json").read_text())
        fresh = {r["nodes"]: r for r in doc["sizes"]}
        for r in old["sizes"]:
            r.update(fresh.pop(r["nodes"], {}))
        old["sizes"] = sorted(old["sizes"] + list(fresh.values()), key=lambda r: r["nodes"])
        old["yardstick"] = doc["yardstick"]
        old.setdefault("updated", []).append({"when": doc["when"], "phases": args.phases,
                                              "sizes": [r["nodes"] for r in doc["sizes"]],
                                              **({"note": args.note} if args.note else {})})
        doc = old
    if not args.no_write:
        out = args.out or RESULTS / "fleet"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out.with_suffix(".json"), (json.dumps(doc, indent=1) + "\n").encode(), mode=0o644)
        write_atomic(out.with_suffix(".md"), markdown(doc).encode(), mode=0o644)
    return 0


if __name__ == "__main__":
    sys.exit(main())
