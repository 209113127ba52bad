"""Chaos under load: kill the fleet's processes while streams flow, check every answer.

    python benchmarks/chaos/run.py [--quick] [--out benchmarks/results/chaos]

A whole fleet on loopback as real processes (``tests/integration/fleet.py``:
CA and mTLS, ``llmgw server``, two agents, simulator engines launched through
the real vLLM adapter) with a standalone ``llmgw router`` on the control
plane's watch API.  The load generator (``benchmarks/router/loadgen.py
--check-tokens``) streams chat completions through the router for the whole
run and checks every answer token by token (the simulator numbers its tokens:
none missing, none duplicated, ``[DONE]`` present).  Meanwhile, one at a time:

* ``control-plane``: SIGKILL ``llmgw server``, leave it down ~1 s, start it again;
* ``agent``: SIGKILL one agent, start it again;
* ``engine``: SIGKILL one engine's whole process group (the agent restarts it);
* ``all``: the control plane, every agent and one engine at once, then restart.

After each kill the run waits until the fleet is back to Ready (every replica
ready with a live process, the router routing to all of them) and checks that
no GPU is claimed twice (in the control plane's book and among the live
engines' ``CUDA_VISIBLE_DEVICES``) and that every engine process is one the
control plane knows (no orphan).  Failed requests are attributed to the kill
whose window (kill to back-to-Ready) they fell in.

``--fuzz-examples N`` adds N hypothesis-generated hostile messages on the agent
stream (``tests/integration/streamfuzz.py``) with their counts.

Writes ``<out>.json`` (every number) and ``<out>.md`` (tables and targets).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "integration")]  # tests.support; the real-process fleet

from fleet import (FAST_LIFECYCLE, Fleet, gpu_owners, router_endpoints, shard_identities,  # noqa: E402
                   standalone_router)
from tests.support import procfs  # noqa: E402
from tests.support.logs import tracebacks  # noqa: E402
from tests.support.polling import until  # noqa: E402

LOADGEN = ROOT / "benchmarks" / "router" / "loadgen.py"
MAX_TOKENS = 16
PROFILE = {"env": {"LLMGW_SIM_TOKEN_LATENCY": "0.01"}}  # a stream lasts ~0.2 s: many are in flight at a kill


@dataclass
class Plan:
    control_plane: int = 20
    agent: int = 10
    engine: int = 3
    all: int = 3
    outage_s: float = 1.0  # how long a killed control plane stays down
    concurrency: int = 4
    nodes: dict[str, int] = field(default_factory=lambda: {"a": 2, "b": 2})
    replicas: int = 3


@dataclass
class Kill:
    phase: str
    index: int
    started: float  # epoch seconds of the kill
    ended: float = 0.0  # epoch seconds when back to Ready
    back_to_ready_s: float = 0.0  # from the restart (the kill for engines) to Ready
    router_resync_s: float | None = None  # control plane restarted -> router has its table
    engines_killed: int = 0
    pid_changes: int = 0
    gpus_twice: list[str] = field(default_factory=list)
    orphans: list[int] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)


class Chaos:
    def __init__(self, root: Path, plan: Plan, seed: int = 1):
        self.root, self.plan = root, plan
        self.rng = random.Random(seed)
        self.kills: list[Kill] = []
        self.gpus_twice_seen: set[str] = set()

    # -- observation ---------------------------------------------------------
    def identities(self) -> dict[str, tuple[str, int, int]]:
        doc = self.f.try_get("/v1/replicas")
        return {} if doc is None else shard_identities(doc)

    def live_engine_gpus(self) -> list[str]:
        """(node, GPU) pairs claimed by more than one live engine, from the engines' own environments."""
        seen: dict[tuple[str, str], int] = {}
        twice = []
        for pid in self.f.engine_pids():
            try:
                env = dict(item.split("=", 1) for item in
                           Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
            except OSError:
                continue
            for gpu in env.get("CUDA_VISIBLE_DEVICES", "").split(","):
                key = (env.get("LLMGW_NODE_ID", "?"), gpu)
                if key in seen:
                    twice.append(f"{key[0]} GPU {gpu}: engines {seen[key]} and {pid}")
                seen[key] = pid
        return twice

    def book_gpus_twice(self) -> list[str]:
        doc = self.f.try_get("/v1/replicas")
        if doc is None:
            return []
        return [f"{node} GPU {gpu}: {shards}" for (node, gpu), shards in gpu_owners(doc).items() if len(shards) > 1]

    def sample_gpus(self) -> None:
        for problem in self.live_engine_gpus() + self.book_gpus_twice():
            self.gpus_twice_seen.add(problem)

    def ready(self, exclude_pids: set[int]) -> dict[str, tuple[str, int, int]] | None:
        """Shard identities once every replica is ready with a live process and the router routes to all."""
        self.sample_gpus()
        ready = self.f.ready_replicas()
        if len(ready) != self.plan.replicas:
            return None
        ids = shard_identities({"replicas": ready})
        if len(ids) != self.plan.replicas or any(pid in exclude_pids for _, pid, _ in ids.values()):
            return None
        if router_endpoints(self.router_port) != self.plan.replicas:
            return None
        return ids

    def orphans(self, known: dict[str, tuple[str, int, int]]) -> list[int]:
        """Engine processes of this fleet the control plane does not report, once things settled."""
        want = {pid for _, pid, _ in known.values()}
        try:
            until(lambda: set(self.f.engine_pids()) <= want, "leftover engines to be gone", timeout=20)
        except AssertionError:
            pass
        return sorted(set(self.f.engine_pids()) - want)

    def router_tables(self) -> int:
        """How many times the router has taken a table from the watch after a failure."""
        return self.router.output(10**8).count("endpoint(s) at revision")

    # -- kills ---------------------------------------------------------------
    def _kill_engine(self) -> int:
        pid = self.rng.choice(self.f.engine_pids())
        os.killpg(pid, signal.SIGKILL)
        return pid

    def step(self, phase: str, index: int) -> Kill:
        f = self.f
        before = self.identities()
        tables = self.router_tables()
        k = Kill(phase, index, time.time())
        killed: set[int] = set()
        restarted_at = time.monotonic()
        if phase in ("control-plane", "all"):
            f.server.kill()
        if phase == "agent":
            self.rng.choice(list(f.agents.values())).kill()
        if phase == "all":
            for a in f.agents.values():
                a.kill()
        if phase in ("engine", "all"):
            killed.add(self._kill_engine())
        if phase in ("control-plane", "all"):
            time.sleep(self.plan.outage_s)  # the router serves from its last table meanwhile
            f.server.start()
            restarted_at = time.monotonic()
        for a in f.agents.values():
            if not a.alive():
                a.start()
        if phase in ("control-plane", "all"):
            f.wait_healthy()
        after = until(lambda: self.ready(killed), f"{phase} kill {index}: back to Ready", on_timeout=f.dump)
        k.back_to_ready_s = round(time.monotonic() - restarted_at, 3)
        if phase in ("control-plane", "all"):
            until(lambda: self.router_tables() > tables, f"{phase} kill {index}: the router to resync",
                  on_timeout=self.router.output)
            k.router_resync_s = round(time.monotonic() - restarted_at, 3)
        k.ended = time.time()
        k.engines_killed = len(killed)
        k.pid_changes = len(set(before.values()) - set(after.values()))  # engines no longer serving
        k.orphans = self.orphans(after)
        k.gpus_twice = sorted(set(self.live_engine_gpus() + self.book_gpus_twice()))
        return k

    # -- the run -------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        p = self.plan
        with Fleet(self.root / "fleet", nodes=p.nodes, replicas=p.replicas, profile=PROFILE) as f:
            self.f = f
            f.start()
            f.wait_ready(p.replicas)
            self.router, self.router_port = standalone_router(f)
            until(lambda: router_endpoints(self.router_port) == p.replicas, "the router's table",
                  on_timeout=self.router.output)
            stop_file = self.root / "stop-load"
            events = self.root / "load-events.jsonl"
            load = subprocess.Popen(
                [sys.executable, str(LOADGEN), "--url", f"http://127.0.0.1:{self.router_port}", "--model", "tiny",
                 "--stream", "--check-tokens", "--max-tokens", str(MAX_TOKENS), "--concurrency", str(p.concurrency),
                 "--duration", "100000", "--request-timeout", "60", "--stop-file", str(stop_file),
                 "--events", str(events)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            cpu0 = (procfs.cpu_seconds(self.router.pid) or 0.0)
            t0 = time.time()
            try:
                time.sleep(2.0)  # steady load before the first kill
                order = (["control-plane"] * p.control_plane + ["agent"] * p.agent + ["engine"] * p.engine
                         + ["all"] * p.all)
                counters: dict[str, int] = {}
                for phase in order:
                    counters[phase] = counters.get(phase, 0) + 1
                    self.kills.append(self.step(phase, counters[phase]))
                    time.sleep(0.5)
                time.sleep(1.0)  # steady load after the last kill
            finally:
                stop_file.touch()
                try:
                    out, err = load.communicate(timeout=120)
                except subprocess.TimeoutExpired:
                    load.kill()
                    out, err = load.communicate()
            elapsed = time.time() - t0
            router_cpu = (procfs.cpu_seconds(self.router.pid) or 0.0) - cpu0
            if load.returncode != 0 or not out.strip():
                raise RuntimeError(f"load generator failed ({load.returncode}): {err[-3000:]}")
            result = json.loads(out.strip().splitlines()[-1])
            final = self.identities()
            orphans = self.orphans(final)
            server_tracebacks = len(tracebacks(f.server.output(10**9)))
        failures = [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []
        unattributed = self.attribute(failures)
        return self.summary(result, failures, unattributed, orphans, elapsed, router_cpu, server_tracebacks)

    def attribute(self, failures: list[dict[str, Any]]) -> dict[str, int]:
        """Charge each failed request to the kill whose window it fell in; the rest are returned."""
        rest: dict[str, int] = {}
        for ev in failures:
            for k in self.kills:
                if k.started - 0.5 <= ev["t"] <= k.ended + 0.5:
                    k.failures[ev["kind"]] = k.failures.get(ev["kind"], 0) + 1
                    break
            else:
                rest[ev["kind"]] = rest.get(ev["kind"], 0) + 1
        return rest

    def summary(self, load: dict[str, Any], failures: list[dict[str, Any]], unattributed: dict[str, int],
                orphans: list[int], elapsed: float, router_cpu: float, tracebacks: int) -> dict[str, Any]:
        phases = {}
        for phase in ("control-plane", "agent", "engine", "all"):
            ks = [k for k in self.kills if k.phase == phase]
            if not ks:
                continue
            fails: dict[str, int] = {}
            for k in ks:
                for kind, n in k.failures.items():
                    fails[kind] = fails.get(kind, 0) + n
            btr = [k.back_to_ready_s for k in ks]
            resync = [k.router_resync_s for k in ks if k.router_resync_s is not None]
            phases[phase] = {
                "kills": len(ks), "failed_requests": sum(fails.values()), "failures_by_kind": fails,
                "integrity_errors": fails.get("integrity", 0),
                "engines_killed": sum(k.engines_killed for k in ks),
                "engine_pid_changes": sum(k.pid_changes for k in ks),
                "engine_restarts_unasked": sum(max(0, k.pid_changes - k.engines_killed) for k in ks),
                "gpus_twice": sum(len(k.gpus_twice) for k in ks),
                "orphans": sum(len(k.orphans) for k in ks),
                "back_to_ready_s": spread(btr),
                "router_resync_s": spread(resync) if resync else None,
            }
        return {
            "plan": asdict(self.plan),
            "requests": load["requests"], "ok": load["ok"],
            "failed_requests": load["requests"] - load["ok"],
            "integrity_errors": load["integrity_errors"], "cut_midstream": load["cut_midstream"],
            "failures_by_kind": load["errors"], "failures_outside_kill_windows": unattributed,
            "failure_samples": failures[:20],
            "orphans_at_end": orphans,
            "gpus_twice_ever": sorted(self.gpus_twice_seen),
            "server_tracebacks": tracebacks,
            "duration_s": round(elapsed, 1), "rps": round(load["ok"] / elapsed, 1) if elapsed else 0,
            "router_cpu_s": round(router_cpu, 2),
            "phases": phases,
            "kills": [asdict(k) for k in self.kills],
        }


def spread(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "min": min(values), "median": round(statistics.median(values), 3), "max": max(values)}


# ------------------------------------------------------------------- report

TARGETS = [
    ("failed requests, control-plane kills", lambda r: r["phases"].get("control-plane", {}).get("failed_requests"), 0),
    ("failed requests, agent kills", lambda r: r["phases"].get("agent", {}).get("failed_requests"), 0),
    ("failed requests other than streams a dying engine cut (all phases)",
     lambda r: r["failed_requests"] - r["cut_midstream"], 0),
    ("integrity errors (all phases)", lambda r: r["integrity_errors"], 0),
    ("engine restarts nobody asked for", lambda r: sum(p["engine_restarts_unasked"] for p in r["phases"].values()), 0),
    ("GPUs assigned twice (ever sampled)", lambda r: len(r["gpus_twice_ever"]), 0),
    ("orphan engine processes", lambda r: len(r["orphans_at_end"]) + sum(p["orphans"] for p in r["phases"].values()), 0),
    ("tracebacks in the control plane's log", lambda r: r["server_tracebacks"], 0),
]


FUZZ_TARGETS = [
    ("fuzzing: hostile streams the server left open", lambda z: len(z["not_closed"]), 0),
    ("fuzzing: re-registrations of the real agent", lambda z: z["bystander_reregistrations"], 0),
    ("fuzzing: failed router requests", lambda z: z["router_failed"], 0),
    ("fuzzing: tracebacks in the control plane's log", lambda z: z["server_tracebacks"], 0),
]


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [(name, fn(r), goal) for name, fn, goal in TARGETS]
    if r.get("fuzz"):
        rows += [(name, fn(r["fuzz"]), goal) for name, fn, goal in FUZZ_TARGETS]
    return [{"target": name, "goal": goal, "measured": got, "met": got == goal} for name, got, goal in rows]


def markdown(r: dict[str, Any], command: str) -> str:
    lines = ["# Chaos under load", "",
             f"`{command}` on {platform.node() or 'this host'} ({os.cpu_count()} CPUs), "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", "",
             "A standalone `llmgw router` on the control plane's watch API carries a steady streaming load "
             f"({r['plan']['concurrency']} closed-loop clients, {MAX_TOKENS}-token chat streams, every answer "
             "checked token by token) while processes are SIGKILLed one kill at a time; after each kill the run "
             "waits until every replica is Ready again and the router routes to all of them. "
             f"{r['plan']['replicas']} replicas on {len(r['plan']['nodes'])} nodes "
             f"({sum(r['plan']['nodes'].values())} simulated GPUs); the control plane's startup grace is "
             f"{FAST_LIFECYCLE['startup_grace']:g} s and a killed control plane stays down "
             f"{r['plan']['outage_s']:g} s.", "",
             "## Targets", "", "| target | goal | measured | met |", "|---|---|---|---|"]
    for t in targets(r):
        lines.append(f"| {t['target']} | {t['goal']} | {t['measured']} | {'yes' if t['met'] else 'no'} |")
    lines += ["", "## Totals", "",
              f"- requests: {r['requests']} ({r['ok']} whole and correct, {r['rps']} per second over "
              f"{r['duration_s']} s); failed: {r['failed_requests']} "
              f"(cut mid-stream with an error event: {r['cut_midstream']}, integrity errors: {r['integrity_errors']})",
              f"- failures by kind: {json.dumps(r['failures_by_kind'])}; outside any kill window: "
              f"{json.dumps(r['failures_outside_kill_windows'])}",
              f"- router CPU over the run: {r['router_cpu_s']} s (utime+stime from /proc)",
              "", "## Per kind of kill", "",
              "| killed | kills | failed requests | integrity errors | engines killed | engine pid changes | "
              "unasked restarts | GPUs twice | orphans | back to Ready s (min / median / max) | "
              "router resync s (median / max) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, p in r["phases"].items():
        b, rs = p["back_to_ready_s"], p["router_resync_s"]
        kinds = f" {json.dumps(p['failures_by_kind'])}" if p["failures_by_kind"] else ""
        resync = f"{rs['median']} / {rs['max']}" if rs else "-"
        lines.append(f"| {name} | {p['kills']} | {p['failed_requests']}{kinds} | {p['integrity_errors']} | "
                     f"{p['engines_killed']} | {p['engine_pid_changes']} | {p['engine_restarts_unasked']} | "
                     f"{p['gpus_twice']} | {p['orphans']} | {b['min']} / {b['median']} / {b['max']} | {resync} |")
    lines += ["", "Back to Ready counts from the restart (control plane, all) or the kill (agent, engine) until "
              "every replica is ready with a live process and the router's table holds all of them. Router resync "
              "counts from the control plane's restart until the router took the new control plane's table; the "
              "watch is held for the startup grace (during which it answers 503, \"keep what you have\"), so it is "
              "the grace plus at most one retry interval.",
              "", "A killed engine's in-flight streams cannot be retried once their first token has reached the "
              "client (a retry would repeat tokens): they end with an in-band error event and `[DONE]`, and "
              "count as failed (`cut_midstream`), never as a silently short answer."]
    if r.get("fuzz"):
        fz = r["fuzz"]
        lines += ["", "## Agent stream fuzzing", "",
                  f"{fz['examples']} hypothesis-generated messages from a node certificate against the live "
                  "control plane, each on its own stream, while a real agent stays connected and the router "
                  "serves (hypothesis runs fewer distinct inputs of a kind whose inputs are few):", "",
                  "| kind | tried | stream closed by the server |", "|---|---|---|"]
        for kind, c in sorted(fz["by_kind"].items()):
            lines.append(f"| {kind} | {c['tried']} | {c['closed']} |")
        lines += ["", f"Reference agent re-registrations during fuzzing: {fz['bystander_reregistrations']}; "
                      f"router requests during fuzzing: {fz['router_ok']} ok, {fz['router_failed']} failed; "
                      f"tracebacks in the control plane's log: {fz['server_tracebacks']}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 kills of each kind, 1 of all at once")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "chaos"))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fuzz-examples", type=int, default=0,
                    help="also send N generated hostile messages on the agent stream")
    args = ap.parse_args(argv)
    plan = Plan(control_plane=2, agent=2, engine=1, all=1) if args.quick else Plan()
    with tempfile.TemporaryDirectory(prefix="llmgw-chaos-") as tmp:
        result = Chaos(Path(tmp), plan, seed=args.seed).run()
        if args.fuzz_examples:
            from streamfuzz import fuzz_fleet

            result["fuzz"] = fuzz_fleet(Path(tmp) / "fuzz", args.fuzz_examples)
    command = "python benchmarks/chaos/run.py" + (" --quick" if args.quick else "") + \
        (f" --fuzz-examples {args.fuzz_examples}" if args.fuzz_examples else "")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result["targets"] = targets(result)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result, command))
    print(markdown(result, command))
    return 0 if all(t["met"] for t in result["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
