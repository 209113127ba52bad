"""The agent stream of a real ``llmgw server``: stale connections and TLS refusals.

Hand-written WebSocket clients present node certificates issued by the
fleet's CA (or foreign/broken ones) so a test controls exactly what goes
over each stream; every effect is read back through the admin API and the
server's own log, as an operator would.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import re
import socket
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from llmgw.tls import init_ca, issue_node, issue_server
from llmgw.tls.ca import utcnow
from llmgw.tls.context import client_context
from llmgw.tls.files import write_pair

from fleet import Fleet, register_message, self_signed_node, until

pytestmark = pytest.mark.integration

STREAM = "/v1/agent/stream"
CLOSED = (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING)


def replica_of(f: Fleet, replica_id: str) -> dict[str, Any] | None:
    return next((r for r in f.replicas()["replicas"] if r["replica_id"] == replica_id), None)


async def next_json(ws: aiohttp.ClientWebSocketResponse, want: str, timeout: float = 120) -> dict[str, Any]:
    """The next message of type ``want`` (skipping others); fails on close."""
    async def loop() -> dict[str, Any]:
        while True:
            msg = await ws.receive()
            if msg.type != aiohttp.WSMsgType.TEXT:
                raise AssertionError(f"stream closed ({msg.type.name}) while waiting for {want}")
            doc = json.loads(msg.data)
            if doc["type"] == want:
                return doc
    return await asyncio.wait_for(loop(), timeout)


def test_messages_on_a_superseded_stream_change_nothing(tmp_path):
    # Long lifecycle: nothing but the streams can change what the API shows. A long keepalive too:
    # these hand-made streams neither heartbeat nor ping, and a stream that carries nothing for two
    # keepalive intervals is closed as half-open.
    with Fleet(tmp_path, nodes={}, replicas=1,
               lifecycle={"unreachable_after": 60, "lost_after": 120, "keepalive_interval": 20}) as f:
        f.start()
        node = f"node-stale-{f.suffix}"
        cert = f.pki.node(node)
        ctx = client_context(f.pki.ca_cert, *cert)
        url = f.url.replace("https", "wss") + STREAM

        async def scenario() -> dict[str, Any]:
            out: dict[str, Any] = {}
            async with aiohttp.ClientSession() as s:
                async with s.ws_connect(url, ssl=ctx) as old:
                    await old.send_str(json.dumps(register_message(node)))
                    out["e1"] = (await next_json(old, "registered"))["epoch"]
                    # The control plane places the catalogued replica on our one GPU.
                    start = await next_json(old, "start")
                    spec = out["spec"] = start["spec"]
                    report = {"spec": spec, "state": "starting",
                              "process": {"pid": 4242, "start_time": 1, "boot_id": "boot-test"}}
                    async with s.ws_connect(url, ssl=ctx) as new:
                        await new.send_str(json.dumps(register_message(node, shards=[report])))
                        out["e2"] = (await next_json(new, "registered"))["epoch"]
                        out["before"] = await asyncio.to_thread(replica_of, f, spec["replica_id"])
                        out["node_before"] = (await asyncio.to_thread(f.nodes))[node]
                        # The superseded stream now claims the shard is serving, and beats.
                        claims = [{"type": "shard_status", "shard_id": spec["shard_id"],
                                   "replica_id": spec["replica_id"], "state": "ready", "port": 40123,
                                   "address": "127.0.0.1",
                                   "process": {"pid": 4242, "start_time": 1, "boot_id": "boot-test"}},
                                  {"type": "heartbeat", "seq": 7}]
                        try:
                            for m in claims:
                                await old.send_str(json.dumps(m))
                            out["sent_on_old"] = True
                        except (ConnectionError, RuntimeError) as e:  # closed under us: also "no effect"
                            out["sent_on_old"] = f"{type(e).__name__}: {e}"

                        async def old_closed() -> aiohttp.WSMsgType:
                            while True:
                                msg = await old.receive()
                                if msg.type != aiohttp.WSMsgType.TEXT:
                                    return msg.type
                        out["old_end"] = await asyncio.wait_for(old_closed(), 120)
                        # The server is done with the old stream (everything sent on it was read).
                        await asyncio.to_thread(
                            until, lambda: f"stream of {node} (epoch {out['e1']}) ended" in f.server.output(10**7),
                            "the server to finish the superseded stream", on_timeout=f.server.output)
                        out["after"] = await asyncio.to_thread(replica_of, f, spec["replica_id"])
                        out["node_after"] = (await asyncio.to_thread(f.nodes))[node]
                        # The same claim on the current stream is heard: the claim itself was valid.
                        await new.send_str(json.dumps(claims[0]))
                        out["control"] = await asyncio.to_thread(
                            until, lambda: (r := replica_of(f, spec["replica_id"])) and r["state"] == "ready" and r,
                            "the current stream's claim to take effect", on_timeout=f.dump)
            return out

        out = asyncio.run(scenario())
        assert out["e2"] > out["e1"]
        assert out["old_end"] in CLOSED, out["old_end"]
        before, after = out["before"], out["after"]
        assert before["state"] == "starting" and before["shards"][0]["state"] == "starting", before
        assert after["state"] == before["state"] and after["shards"][0]["state"] == "starting", after
        assert after["shards"][0]["port"] is None and after["endpoint"] is None, after
        n1, n2 = out["node_before"], out["node_after"]
        assert n2["epoch"] == out["e2"] and n2["connected"] is True and n2["state"] == "ready"
        assert n2["registrations"] == n1["registrations"] == 2
        assert out["control"]["shards"][0]["port"] == 40123
        log = f.server.output(10**7)
        assert f"closing stream of {node} (epoch {out['e1']}): superseded by a newer registration" in log
        # Whether the old handler or aiohttp's close discarded it, it never reached the book.
        assert f"{out['spec']['shard_id']} on {node}: ready" in log
        assert log.count(f"{out['spec']['shard_id']} on {node}: ready") == 1, log[-4000:]


def _healthz(f: Fleet, ctx: ssl.SSLContext) -> tuple[str | None, str, ssl.SSLSession | None]:
    """``GET /healthz`` over a raw TLS socket, read to the end: the protocol version, the status line
    and the TLS session (with any tickets the server sent, which come before the answer)."""
    with socket.create_connection(("127.0.0.1", f.port), timeout=60) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        reply = b""
        while chunk := tls.recv(65536):
            reply += chunk
        return tls.version(), reply.split(b"\r\n", 1)[0].decode(), tls.session


def test_tls12_client_is_refused_by_the_server_itself(tmp_path):
    with Fleet(tmp_path, nodes={}, replicas=0) as f:
        f.start()
        node_cert = f.pki.node(f"node-tls12-{f.suffix}")

        def handshake(max_version: ssl.TLSVersion | None) -> str:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            if max_version is not None:
                ctx.maximum_version = max_version
            ctx.load_verify_locations(str(f.pki.ca_cert))
            ctx.load_cert_chain(str(node_cert[0]), str(node_cert[1]))
            version, status, _ = _healthz(f, ctx)
            return f"{version} {status}"

        with pytest.raises(ssl.SSLError):
            handshake(ssl.TLSVersion.TLSv1_2)
        # The same client, allowed 1.3, gets in: the refusal was the protocol version.
        assert handshake(None) == "TLSv1.3 HTTP/1.1 200 OK"
        assert f.server.alive()


def test_the_control_plane_gives_no_session_tickets(tmp_path):
    """No client of the control plane resumes a TLS session, so it sends no tickets: they cost a third
    of a handshake's server CPU, and a resumed session would skip the certificate checks."""
    with Fleet(tmp_path, nodes={}, replicas=0) as f:
        f.start()
        ctx = ssl.create_default_context(cafile=str(f.pki.ca_cert))
        ctx.load_cert_chain(*map(str, f.pki.node(f"node-tickets-{f.suffix}")))
        version, status, session = _healthz(f, ctx)  # read to the end: a ticket would have come first
        assert status.startswith("HTTP/1.1 200"), status
        assert version == "TLSv1.3"
        assert session is not None and not session.has_ticket  # before: two tickets


async def _try_register(f: Fleet, cert: tuple[Path, Path], node_id: str) -> dict[str, Any]:
    ctx = client_context(f.pki.ca_cert, *cert)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(f.url.replace("https", "wss") + STREAM, ssl=ctx) as ws:
                await ws.send_str(json.dumps(register_message(node_id)))
                msg = await ws.receive(timeout=60)
                return {"reply": msg.data if msg.type == aiohttp.WSMsgType.TEXT else msg.type.name}
    except aiohttp.WSServerHandshakeError as e:
        return {"http_status": e.status}
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
        return {"connection_error": f"{type(e).__name__}: {e}"}


def test_each_refused_client_certificate_is_logged_with_its_reason(tmp_path):
    with Fleet(tmp_path / "f", nodes={}, replicas=0) as f:
        f.start()
        node = f"node-refused-{f.suffix}"
        other_ca = init_ca(tmp_path / "other-ca")
        cases = {  # what -> (certificate, the reason the log must give)
            "self-signed": (write_pair(tmp_path / "self", *self_signed_node(node)), r"self[- ]signed certificate"),
            "other-ca": (write_pair(tmp_path / "other", *issue_node(other_ca, node)),
                         r"unable to get local issuer certificate|unknown ca|issuer"),
            "expired": (write_pair(tmp_path / "expired", *issue_node(f.pki.ca, node, days=1,
                                                                   now=utcnow() - dt.timedelta(days=3))),
                        r"certificate has expired|expired"),
            "serverAuth-only": (write_pair(tmp_path / "server", *issue_server(f.pki.ca, [node], ["127.0.0.1"])),
                                r"unsupported certificate purpose|purpose|key usage"),
        }
        barrier_cert = f.pki.node(f"node-barrier-{f.suffix}")
        missing = {}
        for i, (what, (cert, reason)) in enumerate(cases.items()):
            mark = len(f.server.output(10**8))
            res = asyncio.run(_try_register(f, cert, node))
            assert "registered" not in json.dumps(res), (what, res)
            assert node not in f.nodes(), what
            # A barrier the server does log: a later connection refused for its CN.
            # Whatever the server had to say about the attempt above is in the log before it.
            claimed = f"barrier-{i}-{f.suffix}"
            asyncio.run(_try_register(f, barrier_cert, claimed))
            line = f"claiming {claimed!r}: certificate CN"
            until(lambda: line in f.server.output(10**8)[mark:], "the barrier refusal in the log",
                  on_timeout=f.server.output)
            logged = f.server.output(10**8)[mark:]
            logged = logged[:logged.index(line)]
            if not re.search(reason, logged, re.I):
                missing[what] = logged[-1500:]
        assert not missing, f"refusal reason not in the server log for: {sorted(missing)}\n{missing}"


def test_a_fleet_past_the_heartbeat_cap_is_told_a_longer_interval(tmp_path):
    # A quarter of a heartbeat a second for the whole fleet: the second node is told 8 s, not 0.5 s,
    # and the silences before unreachable and lost grow by as much.
    with Fleet(tmp_path, nodes={}, replicas=0, lifecycle={"max_heartbeats_per_second": 0.25}) as f:
        f.start()
        url = f.url.replace("https", "wss") + STREAM
        told = []

        async def scenario() -> None:
            async with aiohttp.ClientSession() as s:
                for i in range(2):
                    node = f"node-hb{i}-{f.suffix}"
                    ctx = client_context(f.pki.ca_cert, *f.pki.node(node))
                    ws = await s.ws_connect(url, ssl=ctx)
                    await ws.send_str(json.dumps(register_message(node)))
                    told.append((await next_json(ws, "registered"))["heartbeat_interval"])
                with f.client() as c:
                    told.append(c.get("/v1/summary").json()["fleet"])

        asyncio.run(scenario())
        assert told[:2] == [4.0, 8.0]
        lc = told[2]
        assert lc["heartbeat_interval_s"] == 8.0
        assert lc["unreachable_after_s"] == 3.0 + 7.5 and lc["lost_after_s"] == 6.0 + 7.5


def test_a_gpu_an_agent_advertises_despite_its_health_is_not_given_out(tmp_path):
    """An older or faulty agent registers a GPU whose own health block says Xid 79: the control
    plane judges it by the same function the agent and offline explain use, lists it sick, and
    places the replica on the healthy GPU."""
    with Fleet(tmp_path, nodes={}, replicas=1,
               lifecycle={"unreachable_after": 60, "lost_after": 120, "keepalive_interval": 20}) as f:
        f.start()
        node = f"node-sick-{f.suffix}"
        ctx = client_context(f.pki.ca_cert, *f.pki.node(node))
        url = f.url.replace("https", "wss") + STREAM
        register = register_message(node, gpus=2)
        register["hardware"]["gpus"][0]["health"] = {"xid": [79]}

        async def scenario() -> dict[str, Any]:
            async with aiohttp.ClientSession() as s:
                async with s.ws_connect(url, ssl=ctx) as ws:
                    await ws.send_str(json.dumps(register))
                    await next_json(ws, "registered")
                    start = await next_json(ws, "start")
                    return {"start": start, "node": (await asyncio.to_thread(f.nodes))[node]}

        out = asyncio.run(scenario())
        assert out["start"]["spec"]["gpu_indices"] == [1], out["start"]
        hw = out["node"]["hardware"]
        assert [(s["index"], s["reason"]) for s in hw["sick_gpus"]] == [(0, "Xid 79 (GPU has fallen off the bus)")]
        assert [g["index"] for g in out["node"]["gpus"]] == [1]
