"""The parity check's books of replicas: checked once each, forgotten when they leave the table."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from llmgw.router.tokenize_parity import ParityCheck


class Table:
    def __init__(self, *ids: str) -> None:
        self.ids = ids

    def runtimes(self):
        return [SimpleNamespace(id=i, endpoint=SimpleNamespace(model="other")) for i in self.ids]


def test_replicas_gone_from_the_table_are_forgotten():
    check = ParityCheck({}, timeout=1.0)
    check.checked |= {"r1", "r2"}
    check.deferred.update({"r2": 0.0, "r3": 0.0})
    asyncio.run(check.sweep(Table("r2")))
    assert check.checked == {"r2"} and check.deferred == {"r2": 0.0}
    asyncio.run(check.sweep(Table()))
    assert check.checked == set() and check.deferred == {}
