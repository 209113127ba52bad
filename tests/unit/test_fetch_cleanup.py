"""What the fetcher leaves in a target's directory: its tmp names, its sweep, its lock file."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from llmgw.agent.fetch import durable, lock, naming, scratch


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_sidecar_and_stamp_tmp_files_are_recognised_as_ours_and_weights_are_not():
    owner = naming.Owner(123, 456, "abcdef01", "n0")
    meta = naming.meta_name(naming.partial_name("model.safetensors", "n1", owner))
    for of in (meta, naming.verified_name("model.safetensors")):
        tmp = naming.tmp_name(of, 4242)
        assert naming.is_scratch(tmp) and naming.parse_tmp(tmp) == (of, 4242)
    for name in ("model.safetensors", "model.safetensors.tmp12", ".hidden.tmp12", "x.llmgw-meta.tmp1"):
        assert not naming.is_scratch(name) and naming.parse_tmp(name) is None


def test_write_text_leaves_no_tmp_file_when_it_fails(tmp_path):
    (tmp_path / "d").mkdir()
    target = tmp_path / "d" / ".f.llmgw-meta"
    os.mkdir(target)  # rename onto a directory fails after the tmp file was written
    try:
        durable.write_text(target, "{}")
        raise AssertionError("rename onto a directory should fail")
    except OSError:
        pass
    assert sorted(os.listdir(tmp_path / "d")) == [".f.llmgw-meta"]


def test_sweep_removes_tmp_files_of_dead_writers_and_keeps_a_live_ones(tmp_path):
    pid = dead_pid()
    dead = naming.Owner(pid, 1, scratch.boot8(), "aa")
    live = scratch.me("bb")
    scratch.ACTIVE.add("bb")
    try:
        dead_tmp = naming.tmp_name(naming.meta_name(naming.partial_name("m.gguf", "n1", dead)), pid)
        live_tmp = naming.tmp_name(naming.meta_name(naming.partial_name("m.gguf", "n1", live)), os.getpid())
        other_node = naming.tmp_name(naming.meta_name(naming.partial_name("m.gguf", "n2", dead)), pid)
        stamp_tmp = naming.tmp_name(naming.verified_name("m.gguf"), pid)
        other_file = naming.tmp_name(naming.verified_name("n.gguf"), pid)
        for n in (dead_tmp, live_tmp, other_node, stamp_tmp, other_file):
            (tmp_path / n).write_text("{}")
        scratch.sweep_orphans(tmp_path, "m.gguf", "n1")
        assert sorted(os.listdir(tmp_path)) == sorted([live_tmp, other_node, other_file])
    finally:
        scratch.ACTIVE.discard("bb")


def test_the_lock_file_exists_only_while_held_and_a_waiter_still_gets_the_lock(tmp_path):
    path = tmp_path / naming.lock_name("m.gguf")
    order: list[str] = []

    async def holder(name: str, hold: float) -> None:
        async with lock.held(path):
            order.append(f"{name} in")
            assert path.exists()
            await asyncio.sleep(hold)
            order.append(f"{name} out")

    async def main() -> None:
        first = asyncio.create_task(holder("a", 0.5))
        await asyncio.sleep(0.05)
        await asyncio.gather(first, holder("b", 0))

    asyncio.run(main())
    assert order == ["a in", "a out", "b in", "b out"]  # never both: the waiter re-took it on the new file
    assert not path.exists()
