"""The usage record: per minute, key and model, appended once the minute is over; summed by ``ctl keys usage``."""

from __future__ import annotations

import asyncio
import json
import stat
from datetime import datetime, timezone

import pytest

from llmgw.ctl.keys import main, parse_time, sum_usage
from llmgw.router.usagelog import UsageLog

T0 = datetime(2026, 11, 30, 23, 33, tzinfo=timezone.utc).timestamp()  # a minute's start


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_a_minute_is_appended_once_it_is_over_and_the_rest_when_the_worker_stops(tmp_path):
    path = tmp_path / "usage.jsonl"
    clock = Clock(T0 + 5)
    log = UsageLog(str(path), clock)
    log.add("a", "m", 10, 2)
    log.add("a", "m", 5, 1)
    log.add("b", "m", 7, 0)
    assert lines(path) == []  # the minute is not over
    clock.t = T0 + 61
    log.add("a", "m", 1, 1)
    got = [(r["minute"], r["key"], r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in lines(path)]
    assert got == [("2026-11-30T23:33:00Z", "a", 2, 15, 3), ("2026-11-30T23:33:00Z", "b", 1, 7, 0)]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    log.flush()
    assert [(r["minute"], r["requests"]) for r in lines(path)[2:]] == [("2026-11-30T23:34:00Z", 1)]


def test_the_background_job_writes_an_idle_minute_and_everything_when_cancelled(tmp_path):
    path = tmp_path / "usage.jsonl"
    log = UsageLog(str(path))
    log.add("a", "m", 1, 1)

    async def run():
        task = asyncio.create_task(log.run())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert [r["requests"] for r in lines(path)] == [1]


def test_workers_sharing_the_file_are_summed_and_a_torn_line_is_skipped_and_counted(tmp_path, capsys):
    path = tmp_path / "usage.jsonl"
    for t in (T0, T0 + 1):  # two workers, the same minute
        w = UsageLog(str(path), Clock(t))
        w.add("a", "m", 3, 4, cached=2)
        w.flush()
    late = UsageLog(str(path), Clock(T0 + 3600))
    late.add("a", "m", 100, 100)
    late.add("a", "n", 1, 1)
    late.flush()
    with open(path, "a") as f:
        # a line from before cached prompt tokens were recorded (0 of them), and a full disk's torn line
        f.write('{"minute": "2026-12-01T00:33:00Z", "key": "a", "model": "n", "requests": 1, "prompt_tokens": 2, '
                '"completion_tokens": 3, "router": "old", "pid": 1}\n')
        f.write('{"minute": "2026-11-30T23:33:00Z", "key": "a", "mod')
    rows, bad = sum_usage(path.read_text().splitlines(), since=T0, until=T0 + 60)
    assert bad == 1 and [(r.key, r.model, r.requests, r.prompt_tokens, r.cached_prompt_tokens, r.completion_tokens)
                         for r in rows] == [("a", "m", 2, 6, 4, 8)]
    assert main(["keys", "usage", "--log", str(path), "--since", "2026-11-30T23:33Z", "--format", "csv"]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines() == [
        "key,model,requests,prompt_tokens,cached_prompt_tokens,completion_tokens,first_minute,last_minute",
        "a,m,3,106,4,108,2026-11-30T23:33:00Z,2026-12-01T00:33:00Z",
        "a,n,2,3,0,4,2026-12-01T00:33:00Z,2026-12-01T00:33:00Z",
    ]
    assert "1 unreadable line(s) skipped" in out.err


def test_since_takes_an_age_or_an_iso_time_and_anything_else_is_a_clear_error(capsys):
    assert parse_time("24h", 100_000.0) == 100_000.0 - 86400
    assert parse_time("2026-12-01T00:00Z", 0) == parse_time("2026-12-01T00:00:00+00:00", 0)
    assert main(["keys", "usage", "--log", "/dev/null", "--since", "yesterday"]) == 1
    assert "'yesterday': expected an age" in capsys.readouterr().err
