"""Engine keys end to end: real control plane, agent, engine simulator and routers.

Every replica's engine gets its own key from the control plane and refuses a
request without it, the way vLLM does; the routers (in process, and
standalone fed by the watch API with a router certificate) send it, so the
same request succeeds through them.  The key is never on a command line,
survives an agent restart (adoption) and a control-plane restart (the agent
reports it back), and only a router certificate is given it by the watch.
"""

from __future__ import annotations

import json
import ssl
import stat
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from fleet import Fleet, Proc, free_port, llmgw_argv, until

pytestmark = pytest.mark.integration

BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


def engine_env(pid: int) -> dict[str, str]:
    items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(i.decode().split("=", 1) for i in items if b"=" in i)


def rank0(f: Fleet) -> dict:
    (replica,) = f.ready_replicas()
    return next(s for s in replica["shards"] if s["rank"] == 0)


def watch(f: Fleet, cert: tuple[Path, Path]) -> list[dict]:
    with f.client(cert=cert) as c:
        r = c.get("/v1/router/endpoints", params={"after": "-1"})
        assert r.status_code == 200, r.text
        return r.json()["endpoints"]


def standalone_router(f: Fleet) -> tuple[Proc, int]:
    """``llmgw router`` with its own role's certificate: HTTPS to clients, the watch with engine keys."""
    port = free_port()
    cert, key = (str(p) for p in f.pki.router)
    cfg = {"listen": {"host": "127.0.0.1", "port": port}, "allow_unauthenticated": True,
           "tls": {"cert": cert, "key": key},
           "control_plane": {"url": f.url, "ca": str(f.pki.ca_cert), "cert": cert, "key": key}}
    path = f.root / "router.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = Proc("router", llmgw_argv("router", "--config", str(path)), f.root / "router.log", f.root)
    f.extra.append(proc)
    return proc.start(), port


def served(url: str, ca: Path | None = None) -> bool:
    verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(ca)) if ca else True
    try:
        r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30, verify=verify)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and bool(r.json()["choices"])


def openai_over_https(f: Fleet, port: int) -> openai.OpenAI:
    """The official client trusting the fleet CA, and nothing else, for the router's certificate."""
    http = httpx.Client(verify=ssl.create_default_context(cafile=str(f.pki.ca_cert)), timeout=60)
    return openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                         http_client=http)


def test_engine_refuses_direct_requests_and_serves_through_routers_across_restarts(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1, router=True, lifecycle={"startup_grace": 2.0}) as f:
        f.start()
        f.wait_ready(1)
        shard = rank0(f)
        engine = f"http://127.0.0.1:{shard['port']}"
        pid = shard["process"]["pid"]
        key = engine_env(pid)["VLLM_API_KEY"]
        assert len(key) >= 32

        # Direct: refused exactly as vLLM refuses, /health stays open.
        r = httpx.post(f"{engine}/v1/completions", json=BODY, timeout=30)
        assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"})
        r = httpx.post(f"{engine}/v1/completions", json=BODY, headers={"Authorization": "Bearer wrong"}, timeout=30)
        assert r.status_code == 401
        assert httpx.get(f"{engine}/health", timeout=30).status_code == 200
        # Never on a command line, never in the control plane's or agent's logs.
        assert key not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        assert key not in f.server.output() and key not in f.agents["a"].output()
        # The agent's record holds it (that is how it survives restarts), readable by the agent only.
        records = list((tmp_path / "a" / "state" / "shards").glob("*.json"))
        assert len(records) == 1 and stat.S_IMODE(records[0].stat().st_mode) == 0o600
        assert json.loads(records[0].read_text())["spec"]["api_key"] == key

        # Through the in-process router and a standalone one fed by the watch: served.
        assert served(f.router_url, f.pki.ca_cert)
        router, rport = standalone_router(f)
        until(lambda: served(f"https://127.0.0.1:{rport}", f.pki.ca_cert), "the standalone router to serve",
              on_timeout=router.output)
        out = openai_over_https(f, rport).completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert out.choices and out.choices[0].text
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on an https router
            httpx.post(f"http://127.0.0.1:{rport}/v1/completions", json=BODY, timeout=10).raise_for_status()
        # Only a router identity is given the key by the watch.
        assert [e.get("api_key") for e in watch(f, f.pki.router)] == [key]
        assert all("api_key" not in e for e in watch(f, f.pki.admin))
        with f.client(cert=f.pki.node(f.node_ids["a"])) as c:
            assert c.get("/v1/router/endpoints").status_code == 403
        with f.client(cert=f.pki.router) as c:  # the router role opens the watch and nothing else
            assert c.get("/v1/nodes").status_code == 403

        # Agent restart: the engine is adopted with its key, and still refuses requests without it.
        f.agents["a"].kill()
        f.agents["a"].start()
        until(lambda: "adopted pid" in f.agents["a"].life_output(), "the restarted agent to adopt the engine",
              on_timeout=f.agents["a"].output)
        # Control-plane restart: the key is recomputed from the grant the agent presents back.
        f.server.kill()
        f.server.start()
        f.wait_healthy()
        until(lambda: [e.get("api_key") for e in watch(f, f.pki.router)] == [key],
              "the restarted control plane to recover the engine key", on_timeout=f.server.output)
        assert rank0(f)["process"]["pid"] == pid, "no engine was restarted"
        until(lambda: served(f.router_url, f.pki.ca_cert), "the new in-process router to serve",
              on_timeout=f.server.output)
        until(lambda: served(f"https://127.0.0.1:{rport}", f.pki.ca_cert),
              "the standalone router to serve after the restart", on_timeout=router.output)
        assert httpx.post(f"{engine}/v1/completions", json=BODY, timeout=30).status_code == 401
