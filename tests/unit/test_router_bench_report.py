"""The router benchmark's report names a baseline that was asked for but did not run
(benchmarks/router/run.py): its comparisons are marked not measured, not left out; and the
processes it starts run the code it was pointed at."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "router_bench_run", Path(__file__).resolve().parents[2] / "benchmarks" / "router" / "run.py")
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench  # dataclasses look their module up by name
spec.loader.exec_module(bench)

NGINX_LINE = "nginx: not installed (apt-get install nginx-light)"


def row(chunk_us: float) -> dict:
    return {"rps": 100.0, "tokens_per_s": 6400.0, "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0, "latency_p99_ms": 3.0,
            "errors": {}, "steal": {}, "proxy_cpu_per_request_us": 500.0, "proxy_cpu_per_chunk_us": chunk_us,
            "proxy_cpu_util": 0.5}


def results(missing: dict[str, str]) -> dict:
    r = {
        "meta": {"date": "2026-12-05 12:00 UTC", "cpus": 2, "cpu_model": "x", "python": "3.12", "kernel": "6",
                 "quick": True, "placement": "shared", "layouts": ["shared"], "flags": " --quick"},
        "targets": [{"name": "direct", "note": "client straight to the simulator"},
                    {"name": "llmgw-1w", "note": "the router"}],
        "workloads": [{"name": "stream-64", "what": "64 streams"}, {"name": "small-c16", "what": "16 small"}],
        "runs": {"stream-64": {"direct": row(0.0), "llmgw-1w": row(10.0)},
                 "small-c16": {"direct": row(0.0), "llmgw-1w": row(10.0)}},
        "notes": [], "missing": missing,
    }
    r["checks"] = bench.checks(r)
    return r


def test_a_missing_nginx_is_named_with_why():
    res = results({"nginx": bench.NGINX_MISSING})
    assert bench.missing_lines(res) == [NGINX_LINE]
    text = bench.report(res)
    assert f"- {NGINX_LINE}" in text


def test_comparisons_with_a_missing_baseline_are_marked_not_measured():
    res = results({"nginx": bench.NGINX_MISSING, "litellm": "exit status 1"})
    rows = {c["what"]: c for c in res["checks"]}
    nginx = rows["llmgw-1w: CPU per streamed chunk <= 2x nginx (stream-64)"]
    assert (nginx["measured"], nginx["met"]) == ("not measured", None)
    assert nginx["why"] == f"not measured: {NGINX_LINE}"
    assert rows["llmgw-1w: requests/s >= 3x LiteLLM (small-c16)"]["why"] == "not measured: litellm: exit status 1"
    # only workloads that ran are listed
    assert "llmgw-1w: CPU per streamed chunk <= 2x nginx (stream-256x20ms)" not in rows
    text = bench.report(res)
    assert f"| llmgw-1w: CPU per streamed chunk <= 2x nginx (stream-64) | not measured | not measured: {NGINX_LINE} |" \
        in text
    # the workload tables' columns against nginx say so too, instead of a dash
    llmgw_row = next(line for line in text.splitlines() if line.startswith("| llmgw-1w | "))
    assert llmgw_row.endswith("| not measured | not measured | not measured |")


def test_nothing_is_said_of_a_baseline_left_out_on_purpose():
    res = results({})
    assert bench.missing_lines(res) == []
    assert not [c for c in res["checks"] if c["measured"] == "not measured"]
    assert "Missing baselines" not in bench.report(res)


def test_an_earlier_results_file_without_the_key_still_reports():
    res = results({})
    del res["missing"]
    res["checks"] = bench.checks(res)
    assert bench.missing_lines(res) == [] and "# Router benchmark" in bench.report(res)


def test_a_relative_pythonpath_reaches_a_child_run_in_the_work_directory_as_this_trees_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "agent" + bench.os.pathsep + "/abs/lib")
    p = bench.spawn("child", [sys.executable, "-c", "import os; print(os.environ['PYTHONPATH'])"], tmp_path)
    p.proc.wait(30)
    assert p.log.read_text().strip() == bench.os.pathsep.join([bench.os.path.abspath("agent"), "/abs/lib"])
