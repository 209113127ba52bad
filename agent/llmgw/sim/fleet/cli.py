"""``llmgw-fleet-sim``: thousands of simulated agents against a real control plane.

Every simulated agent is a real client of the real protocol (its own node
certificate, TLS 1.3, the WebSocket stream, the agent's own stream client and
supervisor), so what the control plane sees is what a fleet of that size
would show it.  See docs/fleet-sim.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

from llmgw.sim.fleet.control import Command, CommandError, parse_share
from llmgw.sim.fleet.hardware import DEFAULT_MIX, MixError, allocate, builtin_templates, parse_mix

PROG = "llmgw-fleet-sim"


def _whole(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {v}")
        return v
    return parse


_positive_int, _count = _whole(1), _whole(0)


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}")
    return v


def _positive_seconds(text: str) -> float:
    v = _seconds(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text!r}")
    return v


def _share(text: str) -> str:
    try:
        parse_share(text)
    except CommandError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _template(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=PATH (a hardware file)")
    return name, path


def _url(text: str) -> str:
    u = urlsplit(text)
    if u.scheme != "wss" or not u.hostname:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected wss://HOST:PORT/v1/agent/stream (the stream is always mutual TLS)")
    return text


def default_cert_cache() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "llmgw", "fleet-sim")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Run N simulated llmgw agents against a real control plane over the real protocol.",
        epilog="Commands on stdin or --control (one per line, JSON reply): stats, nodes, silence SHARE, "
               "kill SHARE [RESTART_AFTER], restart SHARE, flap SHARE [PERIOD], slow SECONDS [SHARE], "
               "malformed SHARE, oversized SHARE, heal, help, quit.")
    g = p.add_argument_group("fleet")
    g.add_argument("--url", required=True, type=_url, action="append",
                   help="the control plane's stream, wss://HOST:PORT/v1/agent/stream; repeat it for a leader and "
                        "its standbys (the agents follow the leader, as a real agent's list of addresses does)")
    g.add_argument("--ca-dir", required=True, type=Path, help="the fleet CA directory (ca.crt, ca.key) that issues node certificates")
    g.add_argument("--cert-cache", type=Path, default=Path(default_cert_cache()),
                   help="where issued keys and certificates are kept for reruns (default: %(default)s)")
    g.add_argument("--nodes", required=True, type=_positive_int, help="number of simulated agents")
    g.add_argument("--prefix", default="sim", help="node ids are PREFIX-00000, PREFIX-00001, ... (default: %(default)s)")
    g.add_argument("--procs", type=_positive_int, default=1, help="worker processes to spread the agents over (default: 1)")
    g.add_argument("--mix", default=DEFAULT_MIX, help="hardware templates and their weights, NAME=W,... (default: %(default)s)")
    g.add_argument("--template", action="append", type=_template, default=[], metavar="NAME=PATH",
                   help="add a hardware file as template NAME (repeatable); built in: " + ", ".join(builtin_templates()))
    g.add_argument("--nodes-per-address", type=_count, default=1,
                   help="against a control plane on an IPv4 loopback address, agents dial from addresses of their "
                        "own, 127.1.0.0 on, this many to one, as agents on their own machines do (default: 1; "
                        "0: all from the kernel's choice, one address for the whole fleet)")
    g.add_argument("--ramp", type=_seconds, default=0.0, help="spread the agents' first dial over this many seconds (default: 0)")
    g.add_argument("--hold", action="store_true",
                   help="build every agent (its certificate loaded, its TLS context made) and dial only at the `go` "
                        "command: a benchmark that times a control plane's cold start leaves out the simulator's own "
                        "start, which a fleet's agents make on machines of their own")
    g.add_argument("--seed", type=int, default=None, help="seed for choosing the nodes a fault applies to")
    g.add_argument("--duration", type=_seconds, default=0.0, help="exit after this many seconds (default: 0, run until quit or SIGTERM)")
    a = p.add_argument_group("agent behaviour")
    a.add_argument("--fetch-seconds", type=_seconds, default=0.0, help="time each start spends downloading, with progress (default: 0)")
    a.add_argument("--start-seconds", type=_seconds, default=0.5, help="time from launch to ready (default: 0.5)")
    a.add_argument("--stop-seconds", type=_seconds, default=0.2, help="time a stop or drain takes (default: 0.2)")
    a.add_argument("--progress-interval", type=_positive_seconds, default=1.0, help="seconds between progress messages (default: 1)")
    a.add_argument("--reconnect-initial", type=_positive_seconds, default=1.0, help="first reconnect backoff ceiling (default: 1)")
    a.add_argument("--reconnect-max", type=_positive_seconds, default=30.0, help="reconnect backoff ceiling (default: 30)")
    a.add_argument("--keepalive", type=_positive_seconds, default=10.0, help="WebSocket ping interval of each agent (default: 10)")
    e = p.add_argument_group("real engines")
    e.add_argument("--engines", type=_count, default=0,
                   help="run a real llmgw-engine-sim for rank 0 of this many single-node vLLM replicas (default: 0)")
    e.add_argument("--engine-models", default="", metavar="NAME,...",
                   help="only replicas of these catalog models get real engines (default: any)")
    e.add_argument("--engine-command", default=str(Path(sys.executable).parent / "llmgw-engine-sim"),
                   help="the engine simulator to launch (default: %(default)s)")
    e.add_argument("--engine-dir", type=Path, default=None, help="state and logs of real engines (default: a temporary directory)")
    e.add_argument("--engine-ports", default="40000-49999", help="ports real engines may use, FIRST-LAST (default: %(default)s)")
    f = p.add_argument_group("faults from the start (also available as commands)")
    f.add_argument("--silence", type=_share, help="SHARE of nodes silent from the start")
    f.add_argument("--kill", type=_share, help="SHARE of agents killed once started (restart with heal)")
    f.add_argument("--flap", type=_share, help="SHARE of agents flapping")
    f.add_argument("--flap-period", type=_positive_seconds, default=10.0, help="seconds between flaps (default: 10)")
    f.add_argument("--slow-register", type=_seconds, default=0.0, help="seconds between WebSocket up and register")
    f.add_argument("--slow-share", type=_share, default="1", help="SHARE of nodes registering slowly (default: all)")
    f.add_argument("--malformed", type=_share, help="SHARE of nodes sending one malformed message once registered")
    f.add_argument("--oversized", type=_share, help="SHARE of nodes sending one oversized message once registered")
    o = p.add_argument_group("output and control")
    o.add_argument("--status-file", type=Path, help="JSON status written atomically every --status-interval")
    o.add_argument("--status-interval", type=_positive_seconds, default=1.0, help="default: 1")
    o.add_argument("--control", type=Path, help="unix socket taking the same commands as stdin")
    o.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot check alone; each problem exits 2 naming its flag."""
    from llmgw.tls.issue import IssueError, validate_node_id

    if args.procs > args.nodes:
        p.error(f"argument --procs: {args.procs} processes for {args.nodes} nodes; use at most --procs {args.nodes}")
    try:
        validate_node_id(node_ids(args.prefix, args.nodes)[-1])
    except IssueError as e:
        p.error(f"argument --prefix: {e}")
    if args.reconnect_initial > args.reconnect_max:
        p.error(f"argument --reconnect-initial: {args.reconnect_initial:g} is above --reconnect-max {args.reconnect_max:g}")
    try:
        first, last = (int(x) for x in args.engine_ports.split("-"))
        if not 1 <= first <= last <= 65535:
            raise ValueError
    except ValueError:
        p.error(f"argument --engine-ports: {args.engine_ports!r}: expected FIRST-LAST within 1-65535")
    args.engine_ports = (first, last)
    if args.engines and not os.access(args.engine_command, os.X_OK):
        p.error(f"argument --engine-command: {args.engine_command} is not an executable file")
    for flag in ("ca_dir",):
        d = getattr(args, flag)
        if not (d / "ca.crt").is_file() or not (d / "ca.key").is_file():
            p.error(f"argument --ca-dir: {d} holds no CA (ca.crt and ca.key); create one with: llmgw ctl cert init --dir {d}")
    if args.status_file is not None and not args.status_file.parent.is_dir():
        p.error(f"argument --status-file: directory {args.status_file.parent} does not exist")
    if args.control is not None and not args.control.parent.is_dir():
        p.error(f"argument --control: directory {args.control.parent} does not exist")
    for name, path in args.template:
        if not Path(path).is_file():
            p.error(f"argument --template: {name}={path}: no such file")


def node_ids(prefix: str, n: int) -> list[str]:
    width = max(5, len(str(n - 1)))
    return [f"{prefix}-{i:0{width}d}" for i in range(n)]


def start_commands(args: argparse.Namespace) -> list[Command]:
    out = []
    if args.slow_register > 0:
        out.append(Command("slow", args.slow_share, args.slow_register))
    for op in ("silence", "malformed", "oversized"):
        if getattr(args, op):
            out.append(Command(op, getattr(args, op)))
    if args.flap:
        out.append(Command("flap", args.flap, args.flap_period))
    if args.kill:
        out.append(Command("kill", args.kill))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    from llmgw.config import ConfigInvalid
    from llmgw.sim.fleet.hardware import load_templates
    from llmgw.tls.ca import CAError, load_ca

    try:
        templates = load_templates(dict(args.template))
        mix = parse_mix(args.mix, list(templates))
    except MixError as e:
        p.error(str(e))
    except ConfigInvalid as e:
        p.error(f"argument --template: {e}")
    try:
        ca = load_ca(args.ca_dir)
    except CAError as e:
        p.error(f"argument --ca-dir: {e}")
    from llmgw.sim.fleet.worker import run, setup_logging

    setup_logging(args.log_level)
    return run(_run(args, ca, allocate(mix, args.nodes)))


async def _run(args: argparse.Namespace, ca: Any, assignment: list[str]) -> int:
    import logging
    import tempfile

    from llmgw.sim.fleet.certs import ca_fingerprint, ensure_credentials
    from llmgw.sim.fleet.coordinator import Coordinator, LocalHandle, ProcessHandle
    from llmgw.sim.fleet.worker import WorkerSpec

    log = logging.getLogger("llmgw.sim.fleet")
    ids = node_ids(args.prefix, args.nodes)
    t0 = time.monotonic()
    _, counts = await asyncio.to_thread(ensure_credentials, args.cert_cache, ca, ids)
    log.info("credentials for %d node(s) in %.1fs (%d key(s) generated, %d certificate(s) issued; cache %s)",
             len(ids), time.monotonic() - t0, counts.keys_generated, counts.certs_issued, args.cert_cache)
    engine_dir = args.engine_dir
    tmp: tempfile.TemporaryDirectory | None = None
    if args.engines and engine_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="llmgw-fleet-engines-")
        engine_dir = Path(tmp.name)
    timings = {"fetch": args.fetch_seconds, "start": args.start_seconds, "stop": args.stop_seconds,
               "progress_interval": args.progress_interval}
    engines_per_proc = [args.engines // args.procs + (1 if i < args.engines % args.procs else 0)
                        for i in range(args.procs)]
    urls: str | list[str] = args.url[0] if len(args.url) == 1 else list(args.url)
    specs = [WorkerSpec(url=urls, ca_file=str(ca.cert_path), cert_cache=str(args.cert_cache),
                        ca_fingerprint=ca_fingerprint(ca), node_ids=ids, templates=assignment,
                        extra_templates=dict(args.template), numbers=list(range(i, args.nodes, args.procs)),
                        timings=timings, reconnect_initial=args.reconnect_initial,
                        reconnect_max=args.reconnect_max, keepalive=args.keepalive,
                        ramp=args.ramp, engines=engines_per_proc[i], engine_command=[args.engine_command],
                        engine_dir=str(engine_dir) if engine_dir else None, engine_ports=args.engine_ports,
                        engine_models=[m for m in args.engine_models.split(",") if m],
                        nodes_per_address=args.nodes_per_address, hold=args.hold)
             for i in range(args.procs)]
    handles: list[Any] = ([LocalHandle(specs[0])] if args.procs == 1
                          else [ProcessHandle(s, "DEBUG" if args.log_level == "DEBUG" else "WARNING") for s in specs])
    meta = {"url": urls, "nodes_total": args.nodes, "procs_total": args.procs, "prefix": args.prefix}
    coord = Coordinator(handles, ids, args.seed, meta)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, coord.done.set)
    background: list[asyncio.Task[Any]] = []
    server = None
    try:
        try:
            await asyncio.gather(*(h.start() for h in handles))
        except RuntimeError as e:
            log.error("%s", e)
            coord.failed = str(e)
            return 1
        log.info("%d agent(s) in %d process(es) %s %s", args.nodes, args.procs,
                 "held until `go`, then dialling" if args.hold else "dialling", ", ".join(args.url))
        for cmd in start_commands(args):
            log.info("%s: %s", cmd.op, await coord.execute(cmd))
        if args.status_file is not None:
            background.append(asyncio.create_task(coord.write_status(args.status_file, args.status_interval)))
        if args.control is not None:
            server = await coord.serve_socket(args.control)
        background.append(asyncio.create_task(coord.serve_stdin()))
        if args.duration > 0:
            loop.call_later(args.duration, coord.done.set)
        await coord.done.wait()
    finally:
        for t in background:
            t.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        if server is not None:
            server.close()
            with contextlib.suppress(FileNotFoundError):
                args.control.unlink()
        await asyncio.gather(*(h.close() for h in handles), return_exceptions=True)
        if tmp is not None:
            tmp.cleanup()
    return 1 if coord.failed else 0


if __name__ == "__main__":
    sys.exit(main())
