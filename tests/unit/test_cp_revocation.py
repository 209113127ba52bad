"""The control plane's use of the revocation list: which streams a reload closes, and held polls ended."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from llmgw.controlplane.revocation import close_revoked_streams, install, unless_revoked
from llmgw.tls import Revocations


class FakeSession:
    def __init__(self) -> None:
        self.closed: str | None = None

    def close(self, reason: str) -> None:
        self.closed = reason


def test_a_reload_closes_only_the_streams_of_revoked_certificates(tmp_path):
    fp = "ab" * 32
    path = tmp_path / "revoked.txt"
    path.write_text(f"serial 5f\nsha256 {fp}\n")
    sessions = {n: FakeSession() for n in ("by-serial", "by-fingerprint", "fine", "no-certificate")}
    nodes = {
        "by-serial": SimpleNamespace(certificate={"serial": "5f", "fingerprint_sha256": "00" * 32}),
        "by-fingerprint": SimpleNamespace(certificate={"serial": "60", "fingerprint_sha256": fp}),
        "fine": SimpleNamespace(certificate={"serial": "61", "fingerprint_sha256": "11" * 32}),
        "no-certificate": SimpleNamespace(certificate=None),
    }
    closed = close_revoked_streams(SimpleNamespace(sessions=sessions, nodes=nodes), Revocations(path))
    assert sorted(closed) == ["by-fingerprint", "by-serial"]
    assert "serial 5f) is revoked" in sessions["by-serial"].closed
    assert sessions["fine"].closed is None and sessions["no-certificate"].closed is None


def test_a_held_request_ends_when_a_reload_revokes_its_caller(tmp_path):
    path = tmp_path / "revoked.txt"
    path.write_text("")

    async def scenario() -> tuple[object, bool]:
        app = web.Application()
        revs = Revocations(path)
        install(app, revs)
        request = make_mocked_request("GET", "/v1/router/endpoints", app=app)
        cancelled = asyncio.Event()

        async def held_poll() -> str:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return "endpoints with keys"

        task = asyncio.ensure_future(unless_revoked(request, held_poll(), lambda: 0x5F not in revs.current.serials))
        await asyncio.sleep(0.05)
        path.write_text("serial 1\n")  # a reload that does not concern this caller: the poll goes on
        revs.reload()
        await asyncio.sleep(0.05)
        assert not task.done()
        path.write_text("serial 1\nserial 5f\n")
        revs.reload()
        answer = await asyncio.wait_for(task, 5)
        await asyncio.wait_for(cancelled.wait(), 5)
        return answer, cancelled.is_set()

    assert asyncio.run(scenario()) == (None, True)
