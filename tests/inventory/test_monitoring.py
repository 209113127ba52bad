"""llmgw.fleet.monitoring against a real fleet, and a real Prometheus scraping it.

One fleet for the module (control plane with its router, one agent with two
simulated GPUs, one Ready replica). ``playbooks/monitoring.yml`` reads it through
the ``llmgw.fleet.llmgw`` inventory plugin and writes the file_sd targets; the
Prometheus of Debian's ``prometheus`` package, on loopback, scrapes the fleet
from those files, over mutual TLS for the control plane.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import httpx
import pytest
import yaml

from fleet import WAIT, free_port, until
from livefleet import BIN, REPO, LiveFleet, run, running

pytestmark = pytest.mark.integration

PROMETHEUS = shutil.which("prometheus")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with running(tmp_path_factory.mktemp("monitoring"), {"a": 2}, replicas=1, router=True) as lf:
        yield lf


def monitoring(lf: LiveFleet, targets: Path, *extra: str) -> subprocess.CompletedProcess:
    pki = lf.fleet.pki
    params = {"monitoring_targets_dir": str(targets),
              "monitoring_routers": [lf.fleet.router_url],  # HTTPS, the fleet CA's router certificate
              "monitoring_ca_file": str(pki.ca_cert),
              "monitoring_cert_file": str(pki.admin[0]), "monitoring_key_file": str(pki.admin[1])}
    params_file = targets.parent / "monitoring-vars.json"
    params_file.write_text(json.dumps(params))
    argv = [str(BIN / "ansible-playbook"), str(REPO / "playbooks" / "monitoring.yml"),
            "-i", str(lf.plugin_config), "-e", f"@{params_file}", *extra]
    return run(argv, lf.root)


def changed(res: subprocess.CompletedProcess) -> int:
    m = re.search(r"localhost\s+: ok=\d+\s+changed=(\d+)", res.stdout)
    assert m, res.stdout + res.stderr
    return int(m.group(1))


def engines(targets: Path) -> list[dict]:
    return json.loads((targets / "llmgw-engines.json").read_text())


def test_targets_are_written_from_the_live_fleet_idempotently_and_follow_it(live, tmp_path):
    targets = tmp_path / "file_sd"
    res = monitoring(live, targets, "--check", "--diff")
    assert res.returncode == 0, res.stdout + res.stderr
    assert changed(res) >= 1 and not targets.exists()  # check mode reports, writes nothing

    res = monitoring(live, targets)
    assert res.returncode == 0, res.stdout + res.stderr
    [ready] = live.fleet.ready_replicas()
    endpoint = urllib.parse.urlsplit(ready["endpoint"])
    assert engines(targets) == [{
        "targets": [endpoint.netloc],
        "labels": {"__scheme__": "http", "fleet": "llmgw", "model": "tiny", "node": live.node("a"),
                   "profile": "sim", "replica": ready["replica_id"]}}]
    cp = urllib.parse.urlsplit(live.fleet.url)
    assert json.loads((targets / "llmgw-control-plane.json").read_text()) == [
        {"targets": [cp.netloc], "labels": {"__scheme__": "https", "fleet": "llmgw"}}]
    scrape = yaml.safe_load((targets / "llmgw-scrape.yml").read_text())
    assert [j["job_name"] for j in scrape["scrape_configs"]] == [
        "llmgw-control-plane", "llmgw-routers", "llmgw-engines"]

    res = monitoring(live, targets)
    assert res.returncode == 0 and changed(res) == 0, res.stdout

    # The fleet moves (an operator drains the replica; a new one replaces it): the
    # next run shows the change in --check --diff, and then writes it.
    live.fleet.ctl("drain", ready["replica_id"])
    [new] = live.fleet.wait_ready(1, extra=lambda rs: rs[0]["replica_id"] != ready["replica_id"])
    res = monitoring(live, targets, "--check", "--diff")
    assert res.returncode == 0 and changed(res) == 1, res.stdout
    assert re.search(rf'^-\s+"replica": "{ready["replica_id"]}"', res.stdout, re.M), res.stdout
    assert re.search(rf'^\+\s+"replica": "{new["replica_id"]}"', res.stdout, re.M), res.stdout
    assert engines(targets)[0]["labels"]["replica"] == ready["replica_id"]
    res = monitoring(live, targets)
    assert res.returncode == 0 and changed(res) == 1, res.stdout
    assert [g["labels"]["replica"] for g in engines(targets)] == [new["replica_id"]]


def test_an_https_control_plane_without_a_client_certificate_is_refused_by_name(live, tmp_path):
    targets = tmp_path / "file_sd"
    res = monitoring(live, targets, "-e", "monitoring_cert_file=")
    assert res.returncode != 0
    assert "needs an admin client certificate" in res.stdout and live.fleet.url in res.stdout
    assert not targets.exists()


def query(base: str, promql: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=30) as r:
        doc = json.loads(r.read())
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


def test_prometheus_scrapes_the_fleet_from_the_generated_targets(live, tmp_path):
    assert PROMETHEUS, "prometheus is not installed: `make prometheus` installs Debian's package"
    targets = tmp_path / "file_sd"
    res = monitoring(live, targets)
    assert res.returncode == 0, res.stdout + res.stderr
    jobs = yaml.safe_load((targets / "llmgw-scrape.yml").read_text())["scrape_configs"]
    config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
              "scrape_configs": jobs}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--web.listen-address=127.0.0.1:{port}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}"], stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        with httpx.Client(timeout=30, verify=live.fleet.router_verify()) as c:  # through the router, for its series
            c.post(f"{live.fleet.router_url}/v1/completions",
                   json={"model": "tiny", "prompt": "hi", "max_tokens": 2}).raise_for_status()

        def all_up():
            if proc.poll() is not None:
                raise AssertionError((tmp_path / "prometheus.log").read_text())
            try:
                up = query(base, "up")
            except OSError:
                return None
            by_job = {r["metric"]["job"]: r["value"][1] for r in up}
            return by_job if by_job == {"llmgw-control-plane": "1", "llmgw-routers": "1", "llmgw-engines": "1"} \
                else None
        until(all_up, "Prometheus to scrape all three jobs", WAIT,
              on_timeout=lambda: json.dumps(query(base, "up")) + (tmp_path / "prometheus.log").read_text()[-3000:])

        def answer(promql: str) -> list[dict] | None:
            return query(base, promql) or None
        gpus = until(lambda: answer("sum(llmgw_node_gpus)"), "llmgw_node_gpus in Prometheus", WAIT)
        assert gpus[0]["value"][1] == "2"
        ready = until(lambda: answer('sum(llmgw_replicas{state="ready"})'), "llmgw_replicas in Prometheus", WAIT)
        assert ready[0]["value"][1] == "1"
        reqs = until(lambda: answer('sum(llmgw_router_requests_total{model="tiny",status="200"})'),
                     "the router's requests in Prometheus", WAIT)
        assert float(reqs[0]["value"][1]) >= 1
        running = until(lambda: answer('vllm:num_requests_running{job="llmgw-engines"}'),
                        "the engine's metrics in Prometheus", WAIT)
        assert running[0]["metric"]["node"] == live.node("a") and running[0]["metric"]["model"] == "tiny"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
