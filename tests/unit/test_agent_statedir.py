"""Shard records: full spec + identity, atomic, 0600; engine logs and their tails."""

import json
import os
import stat

from llmgw.agent.procident import ProcessIdentity
from llmgw.agent.statedir import ShardRecord, StateDir


def _spec(shard_id="qwen.tp1.1-ab12/r0"):
    return {
        "shard_id": shard_id, "replica_id": shard_id.split("/")[0],
        "model": {"name": "qwen", "source": "Qwen/Qwen2.5-0.5B", "served_name": "qwen"},
        "profile": {"name": "tp1", "engine": "vllm", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                    "nodes": 1, "extra_args": ["--enforce-eager"], "env": {"A": "1"}, "start_timeout": 600},
        "rank": 0, "nnodes": 1, "gpu_indices": [0], "env": {}, "master_addr": None, "master_port": None,
    }


def _record(shard_id="qwen.tp1.1-ab12/r0", pid=4242):
    return ShardRecord(spec=_spec(shard_id), state="ready", process=ProcessIdentity(pid, 99, "boot-1"),
                       port=20001, address="10.0.0.5", started_at=1700000000.5, start_deadline=None,
                       argv=("vllm", "serve"), extra={"launch_marker": "launch 1"})


def test_roundtrip_keeps_full_spec_and_identity(tmp_path):
    sd = StateDir(tmp_path / "state")
    rec = _record()
    sd.write(rec)
    records, bad = sd.load()
    assert bad == [] and records == [rec]
    assert records[0].spec == _spec()  # verbatim, so it can be reported back as sent


def test_files_are_private_and_no_temp_file_remains(tmp_path):
    sd = StateDir(tmp_path / "state")
    sd.write(_record())
    sd.write(_record(pid=5555))  # overwrite goes through a temp + rename too
    for d in (sd.root, sd.shards_dir, sd.logs_dir):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    files = list(sd.shards_dir.iterdir())
    assert len(files) == 1 and not files[0].name.startswith(".")
    assert stat.S_IMODE(os.stat(files[0]).st_mode) == 0o600
    assert json.loads(files[0].read_text())["process"]["pid"] == 5555


def test_shard_ids_with_slashes_and_colons_map_to_distinct_files(tmp_path):
    sd = StateDir(tmp_path)
    ids = ["a/r0", "a/r1", "a:b/r0", "a%2Fr0"]
    for i in ids:
        sd.write(_record(i))
    records, bad = sd.load()
    assert bad == [] and sorted(r.shard_id for r in records) == sorted(ids)
    assert all(p.parent == sd.shards_dir for p in map(sd.record_path, ids))
    assert sd.log_path("a/r0").parent == sd.logs_dir


def test_unusable_files_are_reported_with_a_reason(tmp_path):
    sd = StateDir(tmp_path)
    sd.write(_record("ok/r0"))
    (sd.shards_dir / "garbage.json").write_text("{not json")
    (sd.shards_dir / ".x.json.1234.tmp").write_text("{}")  # a write cut short by a crash
    (sd.shards_dir / "old.json").write_text(json.dumps({"version": 0, "spec": {}}))
    moved = _record("elsewhere/r0").to_dict()
    (sd.shards_dir / "renamed.json").write_text(json.dumps(moved))
    records, bad = sd.load()
    assert [r.shard_id for r in records] == ["ok/r0"]
    reasons = {b.path.name: b.reason for b in bad}
    assert set(reasons) == {"garbage.json", ".x.json.1234.tmp", "old.json", "renamed.json"}
    assert "version" in reasons["old.json"]
    assert "does not match" in reasons["renamed.json"]


def test_remove_is_idempotent(tmp_path):
    sd = StateDir(tmp_path)
    sd.write(_record())
    sd.remove("qwen.tp1.1-ab12/r0")
    sd.remove("qwen.tp1.1-ab12/r0")
    assert sd.load() == ([], [])


def test_log_appends_across_lives_and_tail_starts_at_this_life(tmp_path):
    sd = StateDir(tmp_path)
    sid = "m.p.1-x/r0"
    sd.log_note(sid, "launch AAA of shard")
    fd = sd.open_log(sid)
    os.write(fd, b"first life output\n")
    os.close(fd)
    second = sd.log_size(sid)
    sd.log_note(sid, "launch BBB of shard")
    fd = sd.open_log(sid)
    os.write(fd, b"second life: CUDA out of memory\n")
    os.close(fd)
    whole = sd.log_path(sid).read_text()
    assert "first life output" in whole and "second life" in whole
    assert stat.S_IMODE(os.stat(sd.log_path(sid)).st_mode) == 0o600
    tail = sd.log_tail(sid, since_offset=second)
    assert tail == "second life: CUDA out of memory\n"
    assert sd.log_tail(sid, max_bytes=10).endswith("memory\n")


def test_agent_notes_never_enter_the_engines_log(tmp_path):
    # An engine adopted after every agent restart gets a note each time; its tail must still be its own.
    sd = StateDir(tmp_path)
    sid = "m.p.1-x/r0"
    start = sd.log_size(sid)
    fd = sd.open_log(sid)
    os.write(fd, b"engine: serving\n")
    for i in range(200):
        sd.log_note(sid, f"adopted engine pid 42 after agent restart {i}")
    os.write(fd, b"engine: died of X\n")
    os.close(fd)
    assert sd.log_tail(sid, max_bytes=64, since_offset=start) == "engine: serving\nengine: died of X\n"
    notes = sd.notes_path(sid).read_text()
    assert notes.count("adopted engine pid 42") == 200 and "engine:" not in notes
    assert stat.S_IMODE(os.stat(sd.notes_path(sid)).st_mode) == 0o600


def test_a_truncated_log_is_read_whole_and_old_records_use_the_launch_marker(tmp_path):
    sd = StateDir(tmp_path)
    sid = "m.p.1-x/r0"
    sd.log_path(sid).write_bytes(b"rotated away\n")
    assert sd.log_tail(sid, since_offset=10_000) == "rotated away\n"
    # an engine launched by an agent that wrote its launch line into the engine's log
    sd.log_path(sid).write_bytes(b"old output\n=== llmgw-agent: launch CCC of shard\nthis life\n")
    assert sd.log_tail(sid, since_marker="launch CCC") == "this life\n"
    assert sd.log_tail("never/r0") == ""
