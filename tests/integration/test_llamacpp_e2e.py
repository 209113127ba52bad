"""A real inference engine in the loop: llama.cpp on CPU behind the whole fleet.

``llmgw server`` (control plane and router), ``llmgw agent`` and real ``llama-server``
processes started from the llama.cpp adapter's argv, serving a tiny GGUF model generated
for the test; clients are the official ``openai`` package talking to the router. One
model is a local path, the other an https:// URL on a local test server whose first
response stalls halfway, so the weight fetcher resumes, checks the digest and renames
before a real engine loads what it wrote. Everything the simulator could only imitate
is the engine's own behaviour here: its readiness, its answers, its exit on SIGTERM,
its error messages. The engines serve TLS with the node's engine certificate (llama-server's
``--ssl-key-file``/``--ssl-cert-file``, built with OpenSSL), which the agent's probe and
checks and the router verify against the fleet CA.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmgw.agent.fetch import naming, target_path
from fleet import Fleet, edit_agent_config, shard_identities, until
from llmgw.tls.files import write_pair
from llmgw.tls.issue import issue_engine
from realengine import LLAMA, client, cmdline, engine_log, exe, llama_fleet, needs_llama_server, shard_of
from fetch_support import WeightsServer, tls_server_context
from tinymodel import write_model

pytestmark = [pytest.mark.integration, needs_llama_server]

URL_FILE = "org/tiny/tiny.gguf"
FETCH = {"stall_timeout": 1, "backoff_initial": 0.1, "backoff_max": 0.5, "progress_interval": 0.2}
HEALTH = {"interval": 0.3, "timeout": 5, "fail_after": 30}  # checked often, failed only when truly wedged


@dataclass
class Served:
    f: Fleet
    srv: WeightsServer
    model: Path
    digest: str
    size: int
    logs_at_ready: dict[str, str]  # model -> its engine's output when both replicas were first seen Ready


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamacpp")
    model = root / "tiny.gguf"
    digest = write_model(model)
    data = model.read_bytes()
    tls, ca = tls_server_context(root / "weights-tls")
    with pytest.MonkeyPatch.context() as mp, WeightsServer(tls) as srv:
        mp.setenv("SSL_CERT_FILE", str(ca))  # the agent (a child process) trusts the test server's CA
        srv.add(URL_FILE, data, stall_after=len(data) // 2, stall_times=1)
        f = llama_fleet(root, models=[{"name": "tiny", "source": str(model), "sha256": digest},
                                      {"name": "tiny-url", "source": srv.url(URL_FILE), "sha256": digest}],
                        deployments=[{"model": "tiny", "profile": "cpu", "replicas": 1},
                                     {"model": "tiny-url", "profile": "cpu", "replicas": 1}],
                        agent={"fetch": FETCH, "health": HEALTH})
        crt, key = write_pair(root / "engine", *issue_engine(f.pki.ca, [], ["127.0.0.1"]))
        edit_agent_config(f.agents["a"], lambda d: d.update(engine_tls={"cert": str(crt), "key": str(key)}))
        with f:
            f.start()
            f.wait_ready(2)
            logs = {r["model"]: engine_log(f, r["shards"][0]["shard_id"]) for r in f.ready_replicas()}
            yield Served(f, srv, model, digest, len(data), logs)


def test_replicas_are_real_llama_servers_ready_only_after_they_completed_the_probe(served):
    f = served.f
    for name in ("tiny", "tiny-url"):
        s = shard_of(f, name)
        assert exe(s["pid"]) == str(LLAMA)
        argv = cmdline(s["pid"])
        assert argv[argv.index("--alias") + 1] == name and argv[argv.index("--port") + 1] == str(s["port"])
        # No client has sent anything yet: the one completion the engine reports having
        # served before Ready is the agent's probe (/health alone never makes a replica Ready).
        log = served.logs_at_ready[name]
        assert "print_timing" in log and "eval time" in log and "stop processing" in log, log[-3000:]


def test_llama_server_serves_tls_with_the_engine_certificate(served):
    f = served.f
    for r in f.ready_replicas():
        s = r["shards"][0]
        argv = cmdline(s["pid"])
        assert argv[argv.index("--ssl-cert-file") + 1] == str(f.root / "engine.crt")
        assert (r["endpoint"], r["clear_text"]) == (f"https://127.0.0.1:{s['port']}", False)


def test_replicas_show_the_build_llama_server_reports(served):
    """Read once after Ready from /props (its build_info, behind the engine key), over TLS."""
    res = subprocess.run([str(LLAMA), "--version"], capture_output=True, text=True, timeout=60)
    # "version: 0.5.0-dev (build 1, commit 0c1e570)"; build_info names the same commit
    commit = re.search(r"commit ([0-9a-f]{7,})", res.stdout + res.stderr)
    assert commit, res.stdout + res.stderr
    for r in served.f.ready_replicas():
        assert r["engine_version"] and commit[1] in r["engine_version"], r


def test_liveness_reads_the_engines_metrics_and_sends_it_no_completions(served):
    """llama-server is started with --metrics and the agent reads them with the engine key, so a
    Ready engine's checks cost no completion (which would queue behind the slots' own requests)."""
    import time

    f = served.f
    shard = shard_of(f, "tiny")
    before = engine_log(f, shard["shard_id"]).count("print_timing")
    time.sleep(HEALTH["interval"] * 8)  # several checks while nothing else talks to the engine
    assert engine_log(f, shard["shard_id"]).count("print_timing") == before
    assert "--metrics" in cmdline(shard["pid"])
    assert shard_of(f, "tiny")["pid"] == shard["pid"]  # and the checks passed: same engine, still Ready


def test_openai_client_through_the_router_chat_and_completions(served):
    c = client(served.f)
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                     max_tokens=8, temperature=0)
    (choice,) = chat.choices
    assert chat.object == "chat.completion" and chat.model
    assert choice.finish_reason == "length" and choice.message.role == "assistant" and choice.message.content
    assert chat.usage.completion_tokens == 8 and chat.usage.prompt_tokens > 0
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 8

    chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 6, last
    assert [ch.choices[0].finish_reason for ch in body if ch.choices[0].finish_reason] == ["length"]
    assert "".join(ch.choices[0].delta.content or "" for ch in body)

    done = c.completions.create(model="tiny-url", prompt="The weather", max_tokens=5, temperature=0)
    assert done.object == "text_completion" and done.choices[0].finish_reason == "length"
    assert done.choices[0].text and done.usage.completion_tokens == 5

    streamed = list(c.completions.create(model="tiny-url", prompt="The weather", max_tokens=5, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.completion_tokens == 5
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices)


def test_stop_ends_the_text_before_the_stop_string(served):
    c = client(served.f)
    ask = dict(model="tiny", prompt="Once upon a time", temperature=0)
    full = c.completions.create(max_tokens=24, **ask).choices[0].text
    assert len(full) >= 12, full
    stop = full[6:8]
    cut = c.completions.create(max_tokens=24, stop=[stop], **ask).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[:full.index(stop)]


def test_concurrent_requests_through_the_router_all_complete(served):
    c = client(served.f)

    def one(i: int):
        model = ("tiny", "tiny-url")[i % 2]
        r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": f"request {i}"}],
                                      max_tokens=6)
        return model, r.choices[0].finish_reason, r.usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(16)))
    assert sorted(results) == sorted([(("tiny", "tiny-url")[i % 2], "length", 6) for i in range(16)])


def test_the_url_source_was_resumed_checked_and_renamed_before_the_engine_loaded_it(served):
    f, srv = served.f, served.srv
    final = target_path(srv.url(URL_FILE), f.root / "models")
    assert hashlib.sha256(final.read_bytes()).hexdigest() == served.digest
    s = shard_of(f, "tiny-url")
    argv = cmdline(s["pid"])
    assert argv[argv.index("-m") + 1] == str(final)
    served_file = srv.files[URL_FILE]
    assert served_file.gets == 2, "one stalled response, then one resumed"
    kept = served_file.answers[0].sent
    assert 0 < kept < served.size
    # The resumed request starts one byte early: the fetcher checks that byte matches what it kept.
    assert served_file.requests[1].get("Range") == f"bytes={kept - 1}-" and served_file.requests[1].get("If-Range")
    assert served_file.sent == served.size + 1, "nothing but the one overlap byte was downloaded twice"
    scratch = [p.name for p in final.parent.iterdir() if p.name.endswith((naming.PART_SUFFIX, naming.META_SUFFIX))]
    assert scratch == []


def test_sigkill_of_the_agent_leaves_the_engine_serving_and_the_next_agent_adopts_it(served):
    f = served.f
    before = shard_identities(f.replicas())
    agent = f.agents["a"]
    agent.kill()
    c = client(f)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "still there?"}], max_tokens=3)
    assert r.choices[0].finish_reason == "length", "the engine serves while its agent is dead"
    agent.start()
    until(lambda: agent.life_output().count("adopted pid") == 2, "the new agent to adopt both engines",
          on_timeout=f.dump)
    f.wait_ready(2, extra=lambda ready: shard_identities({"replicas": ready}) == before)
    assert c.completions.create(model="tiny-url", prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_sigkill_of_the_engine_restarts_the_replica_with_a_new_llama_server(served):
    f = served.f
    old = shard_of(f, "tiny")
    os.kill(old["pid"], signal.SIGKILL)
    f.wait_ready(2, extra=lambda ready: any(r["model"] == "tiny" and r["shards"][0]["pid"] not in (None, old["pid"])
                                            for r in ready))
    new = shard_of(f, "tiny")
    assert new["shard_id"] != old["shard_id"] and exe(new["pid"]) == str(LLAMA)
    r = client(f).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "again"}], max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_sigterm_stops_the_engine_within_the_grace(served):
    f = served.f
    s = shard_of(f, "tiny-url")
    f.config["deployments"] = [d for d in f.config["deployments"] if d["model"] != "tiny-url"]
    f.write_config()
    f.server.signal(signal.SIGHUP)
    agent = f.agents["a"]
    until(lambda: any(f"shard {s['shard_id']}: " in line and "-> stopped" in line
                      for line in agent.life_output().splitlines()),
          "the retired shard to stop", on_timeout=f.dump)
    assert "sending SIGKILL" not in agent.life_output(), "llama-server exited on SIGTERM, within the grace"
    assert exe_gone(s["pid"])
    assert "cleaning up before exit" in engine_log(f, s["shard_id"]), "llama-server's own SIGTERM handling ran"
    until(lambda: [r["model"] for r in f.ready_replicas()] == ["tiny"], "only tiny to serve", on_timeout=f.dump)


def exe_gone(pid: int) -> bool:
    try:
        return exe(pid) != str(LLAMA)
    except OSError:
        return True


# ----------------------------------------------------------- failures, quickly

def test_engine_failures_end_the_shard_with_llama_servers_own_message_not_a_hang(tmp_path):
    model = tmp_path / "tiny.gguf"
    write_model(model)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    slow = 600  # far beyond the test's wait: a failure must come from the engine exiting, not from a timeout
    f = llama_fleet(tmp_path, models=[{"name": "broken", "source": str(truncated)},
                                      {"name": "tiny", "source": str(model)}],
                    profiles=[{"name": "cpu", "engine": "llamacpp", "start_timeout": slow},
                              {"name": "typo", "engine": "llamacpp", "start_timeout": slow,
                               "extra_args": ["--no-such-flag", "1"]}],
                    deployments=[{"model": "broken", "profile": "cpu", "replicas": 1},
                                 {"model": "tiny", "profile": "typo", "replicas": 1}],
                    restart={"backoff_initial": 300, "backoff_max": 300})
    with f:
        f.start()

        def failed(model: str):
            doc = f.try_get("/v1/replicas") or {"replicas": []}
            return next((s for r in doc["replicas"] if r["model"] == model for s in r["shards"]
                         if s["state"] == "failed" and s["output_tail"]), None)

        broken = until(lambda: failed("broken"), "the truncated model's shard to fail", timeout=90, on_timeout=f.dump)
        typo = until(lambda: failed("tiny"), "the unknown flag's shard to fail", timeout=90, on_timeout=f.dump)
        assert "failed to load model" in broken["output_tail"], broken["output_tail"][-2000:]
        assert "error: invalid argument: --no-such-flag" in typo["output_tail"], typo["output_tail"][-2000:]
        assert "exited" in broken["reason"] and "exited" in typo["reason"], (broken["reason"], typo["reason"])
