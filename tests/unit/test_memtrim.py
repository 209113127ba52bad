"""The control plane's periodic heap trim: called on its interval, stopped by cancellation."""

from __future__ import annotations

import asyncio

import pytest

from llmgw import memtrim


def test_glibc_trim_is_found_and_callable():
    trim = memtrim._malloc_trim()
    if trim is None:
        pytest.skip("this C library has no malloc_trim")
    assert trim() in (0, 1)  # 1: memory was released, 0: none could be


def test_trims_on_each_interval_until_cancelled(monkeypatch):
    calls = []
    monkeypatch.setattr(memtrim, "_malloc_trim", lambda: lambda: calls.append(1))

    async def main() -> None:
        task = asyncio.create_task(memtrim.trim_periodically(0.01))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert len(calls) >= 3


def test_without_malloc_trim_it_returns_at_once(monkeypatch):
    monkeypatch.setattr(memtrim, "_malloc_trim", lambda: None)
    asyncio.run(asyncio.wait_for(memtrim.trim_periodically(0.01), 1))
