"""The in-process router's endpoint feed: one unusable endpoint must not hide the others."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from llmgw.controlplane.endpointfeed import Published
from llmgw.controlplane.server import RouterHook


def test_an_endpoint_with_an_unusable_url_is_skipped_and_logged(caplog):
    hook = RouterHook(SimpleNamespace(router=None))
    good = {"id": "r1", "model": "m", "url": "http://10.0.0.1:8000", "replica_id": "r1"}
    bad = {"id": "r2", "model": "m", "url": "http://10.0.0.2:99999", "replica_id": "r2"}
    with caplog.at_level(logging.WARNING, logger="llmgw.controlplane"):
        hook.update(Published([bad, good]))
    _, endpoints = hook.table.snapshot()
    assert [e.id for e in endpoints] == ["r1"]
    assert any("r2" in r.getMessage() and "99999" in r.getMessage() for r in caplog.records)
