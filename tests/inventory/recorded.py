"""A recorded control-plane API served on loopback, and the goldens made from it.

``tests/inventory/recorded/`` holds what a real control plane answered
(``regenerate.py --record`` records it from a live fleet); ``serve`` answers
the same documents over HTTP with the same admin-token check, so the plugin
runs its whole request path against it. ``render`` runs ``ansible-inventory``
over it and normalises the one thing that differs per run (the URL).
"""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

from livefleet import BIN, run

HERE = Path(__file__).resolve().parent
RECORDED = HERE / "recorded"
GOLDEN = HERE / "golden"
TOKEN = "recorded-admin-token"
URL_PLACEHOLDER = "http://recorded.invalid"


def documents(root: Path = RECORDED) -> dict[str, bytes]:
    """API path -> body, from ``nodes.json``, ``replicas.json``, ``catalog.json``, ``explain-MODEL.json``."""
    out = {}
    for f in sorted(root.glob("*.json")):
        name = f.stem
        path = f"/v1/explain/{name[len('explain-'):]}" if name.startswith("explain-") else f"/v1/{name}"
        out[path] = f.read_bytes()
    return out


@contextmanager
def serve(docs: dict[str, bytes], token: str = TOKEN) -> Iterator[str]:
    """Answer ``docs`` on a free loopback port, as the admin API does (403 for a wrong token)."""
    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            hits.append(self.path)
            if self.headers.get("Authorization") != f"Bearer {token}":
                self._send(403, json.dumps({"error": "unknown admin token"}).encode())
            elif self.path.split("?", 1)[0] in docs:  # the query ignored, as a control plane before pages does
                self._send(200, docs[self.path.split("?", 1)[0]])
            else:
                self._send(404, json.dumps({"error": f"no {self.path}"}).encode())

        def _send(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.hits = hits  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def plugin_config(path: Path, url: str, **options: Any) -> Path:
    path.write_text(json.dumps({"plugin": "llmgw.fleet.llmgw", "url": url, **options}))
    return path


def normalise(text: str, url: str) -> str:
    return text.replace(url, URL_PLACEHOLDER)


def render(tmp: Path, url: str, config: Path, token: str = TOKEN) -> dict[str, str]:
    """``--list``, ``--graph`` and ``--host`` of every host, as ansible-inventory prints them."""
    env = {"LLMGW_TOKEN": token}
    out: dict[str, str] = {}
    base = [str(BIN / "ansible-inventory"), "-i", str(config)]
    res = run([*base, "--list"], tmp, env)
    assert res.returncode == 0, res.stderr
    out["list.json"] = normalise(res.stdout, url)
    res = run([*base, "--graph"], tmp, env)
    assert res.returncode == 0, res.stderr
    out["graph.txt"] = res.stdout
    for host in sorted(json.loads(out["list.json"])["_meta"]["hostvars"]):
        res = run([*base, "--host", host], tmp, env)
        assert res.returncode == 0, res.stderr
        out[f"host-{host.split('-')[0]}.json"] = normalise(res.stdout, url)
    return out
