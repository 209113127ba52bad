"""``llmgw-fleet-sim`` flags and run-time commands: bad input is refused with a clear reason (exit 2)."""

from __future__ import annotations

import random

import pytest

from llmgw.sim.fleet.cli import build_parser, check_args, main, node_ids, start_commands
from llmgw.sim.fleet.control import Command, CommandError, parse_command, parse_share, select
from llmgw.sim.fleet.coordinator import merge
from llmgw.tls.ca import init_ca


@pytest.fixture(scope="module")
def ca_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ca")
    init_ca(d)
    return d


def base(ca_dir, *extra: str) -> list[str]:
    return ["--url", "wss://127.0.0.1:8443/v1/agent/stream", "--ca-dir", str(ca_dir), "--nodes", "10", *extra]


def refused(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("extra,why", [
    (["--nodes", "0"], "argument --nodes: must be >= 1"),
    (["--nodes", "ten"], "argument --nodes: 'ten' is not a whole number"),
    (["--procs", "11"], "argument --procs: 11 processes for 10 nodes"),
    (["--mix", "nope=1"], "unknown template 'nope'"),
    (["--prefix", "Sim"], "argument --prefix: invalid node id"),
    (["--silence", "1.5"], "argument --silence: share '1.5': must be between 0 and 1"),
    (["--kill", "x"], "argument --kill: share 'x'"),
    (["--start-seconds", "-1"], "argument --start-seconds: must be a finite number of seconds >= 0"),
    (["--progress-interval", "0"], "argument --progress-interval: must be > 0 seconds"),
    (["--reconnect-initial", "5", "--reconnect-max", "2"], "argument --reconnect-initial: 5 is above --reconnect-max 2"),
    (["--engine-ports", "9-2"], "argument --engine-ports: '9-2'"),
    (["--engines", "1", "--engine-command", "/nonexistent"], "argument --engine-command: /nonexistent is not an executable"),
    (["--template", "x"], "argument --template: 'x': expected NAME=PATH"),
    (["--template", "x=/nonexistent.yaml"], "argument --template: x=/nonexistent.yaml: no such file"),
    (["--status-file", "/nonexistent/dir/s.json"], "argument --status-file: directory /nonexistent/dir does not exist"),
])
def test_bad_flags_exit_2_naming_the_flag(capsys, ca_dir, extra, why) -> None:
    assert why in refused(capsys, base(ca_dir, *extra))


def test_the_url_must_be_the_tls_stream(capsys, ca_dir) -> None:
    argv = base(ca_dir)
    argv[1] = "ws://127.0.0.1:8443/v1/agent/stream"
    assert "argument --url: 'ws://127.0.0.1:8443/v1/agent/stream': expected wss://" in refused(capsys, argv)


def test_every_url_is_kept_in_order_and_each_must_be_the_tls_stream(capsys, ca_dir) -> None:
    standby = "wss://127.0.0.1:8444/v1/agent/stream"
    args = build_parser().parse_args(base(ca_dir, "--url", standby))
    assert args.url == ["wss://127.0.0.1:8443/v1/agent/stream", standby]
    assert "argument --url: 'https://127.0.0.1:8444/': expected wss://" in refused(
        capsys, base(ca_dir, "--url", "https://127.0.0.1:8444/"))


def test_a_directory_without_a_ca_is_refused(capsys, tmp_path) -> None:
    assert f"argument --ca-dir: {tmp_path} holds no CA" in refused(capsys, base(tmp_path))


def test_a_template_that_is_not_hardware_is_refused_with_its_pointer(capsys, ca_dir, tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("node_id: x\ngpu_source: simulated\ngpus: [{index: 0}]\n")
    err = refused(capsys, base(ca_dir, "--template", f"bad={bad}", "--mix", "bad=1"))
    assert "argument --template:" in err and "/gpus/0" in err


def test_good_flags_pass_and_start_faults_become_commands(ca_dir) -> None:
    p = build_parser()
    args = p.parse_args(base(ca_dir, "--silence", "5%", "--slow-register", "2", "--slow-share", "n=3",
                             "--flap", "0.1", "--flap-period", "4", "--kill", "ids=sim-00001"))
    check_args(p, args)
    assert args.engine_ports == (40000, 49999)
    assert start_commands(args) == [Command("slow", "n=3", 2.0), Command("silence", "5%"),
                                    Command("flap", "0.1", 4.0), Command("kill", "ids=sim-00001")]


def test_node_ids_are_zero_padded_and_sort_in_order() -> None:
    assert node_ids("sim", 3) == ["sim-00000", "sim-00001", "sim-00002"]
    ids = node_ids("x", 123456)
    assert ids[-1] == "x-123455" and ids == sorted(ids)


@pytest.mark.parametrize("line,cmd", [
    ("stats", Command("stats")),
    ("  SILENCE 0.6 ", Command("silence", "0.6")),
    ("kill 5% 10", Command("kill", "5%", 10.0)),
    ("kill n=3", Command("kill", "n=3")),
    ("flap 0.1 2.5", Command("flap", "0.1", 2.5)),
    ("slow 3", Command("slow", "1", 3.0)),
    ("slow 3 0.2", Command("slow", "0.2", 3.0)),
    ("malformed ids=a,b", Command("malformed", "ids=a,b")),
    ("heal", Command("heal")),
    ("go", Command("go")),
])
def test_commands_parse(line, cmd) -> None:
    assert parse_command(line) == cmd


@pytest.mark.parametrize("line,why", [
    ("", "empty command"),
    ("explode", "unknown command 'explode'"),
    ("stats now", "stats takes no arguments"),
    ("silence", "usage: silence SHARE"),
    ("silence 0.5 3", "usage: silence SHARE"),
    ("kill 2", "must be between 0 and 1"),
    ("kill 0.1 -3", "SECONDS must be a finite number >= 0"),
    ("flap 0.1 0", "flap PERIOD must be > 0"),
    ("slow x", "SECONDS 'x' is not a number"),
    ("oversized n=-1", "share 'n=-1'"),
    ("malformed ids=", "ids= needs at least one node id"),
])
def test_bad_commands_say_why(line, why) -> None:
    with pytest.raises(CommandError, match=why):
        parse_command(line)


def test_selection_draws_from_the_whole_fleet_or_names_nodes() -> None:
    ids = node_ids("sim", 200)
    a, b = select(random.Random(7), ids, "5%"), select(random.Random(7), ids, "5%")
    assert a == b and len(a) == 10 and len(set(a)) == 10
    assert len(select(random.Random(1), ids, "0.6")) == 120
    assert len(select(random.Random(1), ids, "n=500")) == 200
    assert select(random.Random(1), ids, "ids=sim-00003,sim-00001,sim-00003") == [1, 3]
    with pytest.raises(CommandError, match="unknown node id"):
        select(random.Random(1), ids, "ids=sim-99999")
    assert parse_share("n=4") == ("count", 4)


def test_worker_stats_add_up() -> None:
    merged = merge([{"nodes": 2, "shards": {"ready": 1, "pending": 0}, "url": "x"},
                    {"nodes": 3, "shards": {"ready": 2, "failed": 1}}])
    assert merged == {"nodes": 5, "shards": {"ready": 3, "pending": 0, "failed": 1}}
