"""llmgw.fleet.llmgw against a recorded control-plane API served on loopback.

The recording (tests/inventory/recorded/) is what a real fleet's control plane
answered; the goldens (tests/inventory/golden/) are what ansible-inventory
printed for it. ``regenerate.py`` rebuilds both.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from livefleet import BIN, plain, run
from recorded import GOLDEN, TOKEN, documents, plugin_config, render, serve

from tests.support.ports import free_port


JSON_RESULTS = {"ANSIBLE_CALLBACK_RESULT_FORMAT": "json"}


@pytest.fixture(scope="module")
def docs() -> dict[str, bytes]:
    return documents()


def host_names(docs: dict[str, bytes]) -> list[str]:
    return [n["node_id"] for n in json.loads(docs["/v1/nodes"])["nodes"]]


def test_list_graph_and_host_match_the_goldens(tmp_path, docs):
    with serve(docs) as url:
        out = render(tmp_path, url, plugin_config(tmp_path / "recorded.llmgw.yml", url))
    assert sorted(out) == sorted(p.name for p in GOLDEN.iterdir())
    for name, text in out.items():
        assert text == (GOLDEN / name).read_text(), f"{name} differs from its golden (regenerate.py rebuilds them)"


def test_hosts_groups_and_vars_say_what_the_api_said(tmp_path, docs):
    nodes = json.loads(docs["/v1/nodes"])["nodes"]
    replicas = json.loads(docs["/v1/replicas"])["replicas"]
    with serve(docs) as url:
        res = run([str(BIN / "ansible-inventory"), "--list", "--export", "-i",
                   str(plugin_config(tmp_path / "llmgw.yml", url, token=TOKEN))], tmp_path)
    assert res.returncode == 0, res.stderr
    inv = json.loads(res.stdout, object_hook=lambda d: d.get("__ansible_unsafe", d) if len(d) == 1 else d)
    hv = inv["_meta"]["hostvars"]
    assert sorted(hv) == sorted(n["node_id"] for n in nodes)
    for n in nodes:
        h = hv[n["node_id"]]
        assert h["llmgw_live_state"] == n["state"] and h["llmgw_live_agent_version"] == n["agent_version"]
        assert h["llmgw_live_fabrics"] == n["fabrics"]
        assert h["llmgw_live_certificate"] == n["certificate"] and n["certificate"]["not_after"]
        # GPUs in summary (the default): count, names, memory, and no per-GPU list
        assert (h["llmgw_live_gpus_total"], h["llmgw_live_gpus_free"]) == (len(n["gpus"]), n["gpus_free"])
        assert h["llmgw_live_gpu_names"] == sorted({g["name"] for g in n["gpus"]})
        assert h["llmgw_live_gpu_memory_bytes"] == sum(g["memory_bytes"] for g in n["gpus"]) > 0
        assert "llmgw_live_gpus" not in h
        assert n["node_id"] in inv[f"llmgw_state_{n['state']}"]["hosts"]
        assert all(k.startswith("llmgw_live_") for k in h)
        assert "llmgw_live_fleet" not in h  # --export: the summary stays on the all group
    for r in replicas:
        for s in r["shards"]:
            (mine,) = [x for x in hv[s["node_id"]]["llmgw_live_shards"]
                       if f"{x['replica_id']}/r{x['rank']}" == s["shard_id"]]
            assert (mine["replica_id"], mine["model"], mine["profile"], mine["state"], mine["replica_state"], mine["gpus"]) == (
                r["replica_id"], r["model"], r["profile"], s["state"], r["state"], s["gpus"])
            assert mine["endpoint"] == r["endpoint"] if s["rank"] == 0 else "endpoint" not in mine
            assert s["node_id"] in inv[f"llmgw_model_{r['model']}"]["hosts"]
    # the node whose mlx5_1 is in INIT still advertises ib-a through mlx5_0, and says why mlx5_1 is not used
    (partial,) = [n for n in nodes if n["fabrics"][0]["advertised_hcas"] == ["mlx5_0"]]
    assert any("INIT" in p for p in hv[partial["node_id"]]["llmgw_live_fabrics"][0]["problems"])
    assert sorted(inv["llmgw_fabric_ib_a"]["hosts"]) == sorted(hv)
    fleet = inv["all"]["vars"]["llmgw_live_fleet"]
    assert sorted(fleet["deployments"]) == ["big/tp4", "tiny/sim"]
    big = fleet["deployments"]["big/tp4"]
    assert (big["replicas"], big["ready"]) == (1, 0) and big["unplaced"][0]["slot"] == 0
    assert "0 free GPUs, needs 4" in big["explain"][0]["text"]
    tiny = fleet["deployments"]["tiny/sim"]
    assert tiny == {"replicas": 2, "ready": 2}
    assert fleet["nodes"] == len(nodes) and fleet["node_states"] == {"ready": len(nodes)}


def test_gpu_detail_full_lists_every_gpu(tmp_path, docs):
    nodes = json.loads(docs["/v1/nodes"])["nodes"]
    with serve(docs) as url:
        res = run([str(BIN / "ansible-inventory"), "--list", "-i",
                   str(plugin_config(tmp_path / "llmgw.yml", url, token=TOKEN, gpu_detail="full"))], tmp_path)
    assert res.returncode == 0, res.stderr
    hv = plain(json.loads(res.stdout))["_meta"]["hostvars"]
    for n in nodes:
        h = hv[n["node_id"]]
        where = {g["index"]: g for g in n["hardware"]["gpus"]}
        assert h["llmgw_live_gpus"] == [
            {**{k: g[k] for k in ("index", "name", "memory_bytes", "uuid", "shard")},
             **{k: where[g["index"]].get(k) for k in ("numa_node", "cpu_affinity")}} for g in n["gpus"]]
        assert h["llmgw_live_gpus"][0]["shard"] == "%s/r%d" % (h["llmgw_live_shards"][0]["replica_id"], h["llmgw_live_shards"][0]["rank"])
        assert h["llmgw_live_gpu_names"] and h["llmgw_live_gpus_total"] == len(n["gpus"])


def test_compose_groups_keyed_groups_and_strict(tmp_path, docs):
    extra = {"compose": {"ready_shards": "llmgw_live_shards | selectattr('state', 'eq', 'ready') | list | length"},
             "groups": {"has_free_gpu": "llmgw_live_gpus_free > 0", "serving": "ready_shards | int > 0"},
             "keyed_groups": [{"key": "llmgw_live_agent_version", "prefix": "agent"}]}
    with serve(docs) as url:
        inv = json.loads(run([str(BIN / "ansible-inventory"), "--list", "-i",
                              str(plugin_config(tmp_path / "a.llmgw.yml", url, token=TOKEN, **extra))], tmp_path).stdout)
        bad = {"compose": {"x": "no_such_var.field"}}
        lenient = run([str(BIN / "ansible-inventory"), "--list", "-i",
                       str(plugin_config(tmp_path / "b.llmgw.yml", url, token=TOKEN, **bad))], tmp_path)
        strict = run([str(BIN / "ansible-inventory"), "--list", "-i",
                      str(plugin_config(tmp_path / "c.llmgw.yml", url, token=TOKEN, strict=True, **bad))], tmp_path)
    hosts = host_names(docs)
    assert all(inv["_meta"]["hostvars"][h]["ready_shards"] == 1 for h in hosts)
    assert sorted(inv["serving"]["hosts"]) == sorted(hosts)
    assert "has_free_gpu" not in inv  # every GPU of the recording holds a shard
    assert sorted(inv["agent_0.1.0"]["hosts"] if "agent_0.1.0" in inv else inv["agent_0_1_0"]["hosts"]) == sorted(hosts)
    assert lenient.returncode == 0 and all("x" not in v for v in json.loads(lenient.stdout)["_meta"]["hostvars"].values())
    assert strict.returncode != 0 and "Could not set x" in strict.stderr


def test_the_cache_answers_when_the_control_plane_is_gone(tmp_path, docs):
    cache = {"cache": True, "cache_plugin": "ansible.builtin.jsonfile", "cache_connection": str(tmp_path / "cache"),
             "cache_timeout": 3600}
    with serve(docs) as url:
        config = plugin_config(tmp_path / "cached.llmgw.yml", url, token=TOKEN, **cache)
        first = run([str(BIN / "ansible-inventory"), "--list", "-i", str(config)], tmp_path)
    assert first.returncode == 0, first.stderr
    assert list((tmp_path / "cache").iterdir()), "nothing was cached"
    second = run([str(BIN / "ansible-inventory"), "--list", "-i", str(config)], tmp_path)  # nothing listens now
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout) == json.loads(first.stdout)
    fresh = run([str(BIN / "ansible-inventory"), "--list", "--flush-cache", "-i", str(config)], tmp_path)
    assert fresh.returncode != 0 and "did not answer" in fresh.stderr


def test_remote_strings_are_never_templated(tmp_path, docs):
    """A string a node reports (a reason, at the top and inside a shard) stays data in compose and in a play."""
    marker = tmp_path / "templated"
    evil = "{{ lookup('ansible.builtin.pipe', 'touch %s') }}" % marker
    nodes, replicas = json.loads(docs["/v1/nodes"]), json.loads(docs["/v1/replicas"])
    host = nodes["nodes"][0]["node_id"]
    nodes["nodes"][0]["reason"] = evil
    next(s for r in replicas["replicas"] for s in r["shards"] if s["node_id"] == host)["reason"] = evil
    play = [{"name": "use the live variables", "hosts": host, "gather_facts": False, "tasks": [
        {"name": "copy them", "ansible.builtin.set_fact": {"copied": "{{ llmgw_live_reason }} {{ llmgw_live_shards[0].reason }}"}},
        {"name": "show them", "ansible.builtin.debug": {"msg": "{{ copied }}|{{ why }}"}}]}]
    playbook = tmp_path / "use.yml"
    playbook.write_text(yaml.safe_dump(play))
    with serve({**docs, "/v1/nodes": json.dumps(nodes).encode(), "/v1/replicas": json.dumps(replicas).encode()}) as url:
        config = plugin_config(tmp_path / "evil.llmgw.yml", url, token=TOKEN,
                               compose={"why": "llmgw_live_reason"})
        adhoc = run([str(BIN / "ansible"), host, "-i", str(config), "-m", "ansible.builtin.debug",
                     "-a", "var=why"], tmp_path, JSON_RESULTS)
        played = run([str(BIN / "ansible-playbook"), str(playbook), "-i", str(config)], tmp_path, JSON_RESULTS)
    assert adhoc.returncode == 0, adhoc.stdout + adhoc.stderr
    assert json.loads(adhoc.stdout[adhoc.stdout.index("{"):])["why"] == evil
    assert played.returncode == 0, played.stdout + played.stderr
    assert json.dumps(f"{evil} {evil}|{evil}") in played.stdout
    assert not marker.exists()


# The one-liner docs/inventory.md gives for "Ready replicas per model".
READY_PER_MODEL = (r'{"msg": "{% for model, shards in groups.llmgw_live | map(\"extract\", hostvars, \"llmgw_live_shards\")'
                   r' | flatten | selectattr(\"rank\", \"eq\", 0) | selectattr(\"replica_state\", \"eq\", \"ready\")'
                   r' | groupby(\"model\") %}{{ model }}: {{ shards | map(attribute=\"replica_id\") | sort'
                   r' | join(\", \") }}; {% endfor %}"}')


def test_debug_one_liner_lists_ready_replicas_per_model(tmp_path, docs):
    replicas = json.loads(docs["/v1/replicas"])["replicas"]
    with serve(docs) as url:
        res = run([str(BIN / "ansible"), "localhost", "-i", str(plugin_config(tmp_path / "llmgw.yml", url, token=TOKEN)),
                   "-m", "ansible.builtin.debug", "-a", READY_PER_MODEL], tmp_path, JSON_RESULTS)
    assert res.returncode == 0, res.stdout + res.stderr
    shown = json.loads(res.stdout[res.stdout.index("{"):])["msg"]
    ready = sorted(r["replica_id"] for r in replicas if r["state"] == "ready")
    assert ready and shown == f"tiny: {', '.join(ready)}; "
    assert (Path(__file__).resolve().parents[2] / "docs" / "inventory.md").read_text().count(f"-a '{READY_PER_MODEL}'") == 1


@pytest.mark.parametrize("case", ["down", "refused", "half_cert", "bad_url", "no_credentials", "bad_page_size"])
def test_failures_name_the_url_and_the_reason(tmp_path, docs, case):
    with serve(docs) as url:
        options, want = {
            "down": ({"url": f"http://127.0.0.1:{free_port()}"}, "did not answer"),
            "refused": ({"token": "wrong"}, "refused the credentials (HTTP 403): unknown admin token"),
            "half_cert": ({"client_cert": str(tmp_path)}, "client_cert and client_key go together"),
            "bad_url": ({"url": "cp.example:8443"}, "url must be http(s)://HOST[:PORT]"),
            "no_credentials": ({"url": "https://127.0.0.1:1"}, "needs an admin certificate"),
            "bad_page_size": ({"page_size": -1}, "page_size must be a whole number from 0 (no pages) to 10000, got -1"),
        }[case]
        options = {"url": url, "token": TOKEN, **options}
        config = plugin_config(tmp_path / "llmgw.yml", **options)
        if case == "no_credentials":
            doc = yaml.safe_load(config.read_text())
            del doc["token"]
            config.write_text(json.dumps(doc))
        res = run([str(BIN / "ansible-inventory"), "--list", "-i", str(config)], tmp_path)
    assert res.returncode != 0, res.stdout
    err = " ".join(res.stderr.split())
    assert want in err, res.stderr
    if case in ("down", "refused"):
        assert options["url"] in err


def test_only_llmgw_named_files_are_taken(tmp_path, docs):
    with serve(docs) as url:
        config = plugin_config(tmp_path / "fleet.yml", url, token=TOKEN)
        res = run([str(BIN / "ansible-inventory"), "--list", "-i", str(config)], tmp_path)
    assert res.returncode != 0
    assert "could not be verified by inventory plugin 'llmgw.fleet.llmgw'" in " ".join(res.stderr.split())


def test_plugin_does_not_import_the_runtime():
    src = Path(__file__).resolve().parents[2] / "collections/ansible_collections/llmgw/fleet/plugins/inventory/llmgw.py"
    text = src.read_text()
    assert "import llmgw" not in text and "from llmgw" not in text
