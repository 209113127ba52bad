"""Process identity from /proc: pid + start time + boot id."""

import os
import subprocess
import sys
import time

from llmgw.agent import procident
from llmgw.agent.procident import ProcessIdentity, parse_stat


def _stat_line(comm: str, start_time: int = 123456) -> str:
    # Fields 3.. of a real /proc/<pid>/stat line, with field 22 = start_time.
    rest = ["S", "1", "4242", "4242", "0", "-1", "4194560", "100", "0", "0", "0", "5", "3", "0", "0",
            "20", "0", "1", "0", str(start_time), "12345678", "300"]
    return f"4242 ({comm}) " + " ".join(rest) + "\n"


def test_parse_stat_reads_field_22_after_the_last_paren():
    st = parse_stat(_stat_line("evil) S 1 2 3 (name", start_time=987654321))
    assert st.pid == 4242
    assert st.comm == "evil) S 1 2 3 (name"
    assert st.state == "S" and st.ppid == 1 and st.pgid == 4242 and st.sid == 4242
    assert st.start_time == 987654321
    assert (st.utime, st.stime, st.cutime, st.cstime) == (5, 3, 0, 0) and st.cpu_ticks == 8


def test_own_identity_matches_proc():
    me = procident.identify(os.getpid())
    assert me is not None and me.pid == os.getpid()
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert me.boot_id == f.read().strip()
    with open(f"/proc/{os.getpid()}/stat") as f:
        assert me.start_time == int(f.read().rsplit(")", 1)[1].split()[19])
    assert procident.is_same_process(me) and procident.is_running(me)


def test_different_start_time_or_boot_is_another_process():
    me = procident.identify(os.getpid())
    assert not procident.is_same_process(ProcessIdentity(me.pid, me.start_time + 1, me.boot_id))
    assert not procident.is_same_process(ProcessIdentity(me.pid, me.start_time, "another-boot"))
    assert not procident.is_running(ProcessIdentity(me.pid, me.start_time - 1, me.boot_id))


def test_two_processes_never_share_identity_and_exit_is_seen():
    a = subprocess.Popen(["sleep", "30"])
    b = subprocess.Popen(["sleep", "30"])
    try:
        ia, ib = procident.identify(a.pid), procident.identify(b.pid)
        assert ia != ib and procident.is_running(ia) and procident.is_running(ib)
    finally:
        a.kill(); b.kill()
        a.wait(); b.wait()
    assert not procident.is_same_process(ia) and not procident.is_running(ia)
    assert procident.identify(a.pid) is None or procident.identify(a.pid) != ia


def test_zombie_is_same_process_but_not_running():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ident = procident.identify(child.pid)
    assert ident is not None
    deadline = time.monotonic() + 60
    while procident.read_stat(child.pid).state != "Z":  # exited, not yet reaped
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert procident.is_same_process(ident)
    assert not procident.is_running(ident)
    child.wait()
    assert not procident.is_same_process(ident)


def test_environ_and_cmdline_of_a_child():
    child = subprocess.Popen(["sleep", "30"], env={**os.environ, "LLMGW_SHARD_ID": "m.p.1-abc/r0"})
    try:
        deadline = time.monotonic() + 60
        while procident.read_cmdline(child.pid) != ["sleep", "30"]:  # until exec completed
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert procident.read_environ(child.pid)["LLMGW_SHARD_ID"] == "m.p.1-abc/r0"
    finally:
        child.kill()
        child.wait()
    assert procident.read_environ(child.pid) is None and procident.read_cmdline(child.pid) is None


def test_ancestors_include_self_and_parent():
    anc = procident.ancestors()
    assert os.getpid() in anc and os.getppid() in anc and 1 in anc
