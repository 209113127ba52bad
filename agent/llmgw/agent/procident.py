"""Process identity: pid + start time + boot id, never pid alone.

A pid is recycled as soon as its process is reaped, so a shard record that
says "pid 4242" may, after an agent restart or a reboot, describe some other
process entirely.  Signalling it would kill a stranger.  The kernel gives every
process a start time (``/proc/<pid>/stat`` field 22, clock ticks after boot)
that two processes with the same pid cannot share within one boot, and every
boot a fresh ``/proc/sys/kernel/random/boot_id``; together the three identify
one process for the lifetime of the machine.

Every read here is a cheap, non-blocking procfs read, and every "not there"
outcome (process gone, permission denied, a race with exit) is an answer,
not an exception.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from typing import Any, Iterator

PROC = "/proc"


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start_time: int  # clock ticks after boot (/proc/<pid>/stat field 22)
    boot_id: str

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "start_time": self.start_time, "boot_id": self.boot_id}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ProcessIdentity":
        return cls(pid=int(d["pid"]), start_time=int(d["start_time"]), boot_id=str(d["boot_id"]))


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` this package uses (the one parser of that line: the
    fleet simulator's CPU accounting and the test harness read it here too)."""

    pid: int
    comm: str
    state: str  # R, S, D, Z (zombie), T, ...
    ppid: int
    pgid: int
    sid: int
    start_time: int
    # CPU time in clock ticks (os.sysconf("SC_CLK_TCK")): this process's own, and its reaped children's
    utime: int = 0
    stime: int = 0
    cutime: int = 0
    cstime: int = 0

    @property
    def cpu_ticks(self) -> int:
        """User + system time of the process itself (children not counted)."""
        return self.utime + self.stime


def parse_stat(text: str) -> ProcStat:
    """Parse one ``/proc/<pid>/stat`` line.

    ``comm`` (field 2) is in parentheses and may itself contain spaces and
    parentheses, so the remaining fields start after the *last* ``)``.
    """
    open_paren = text.index("(")
    close_paren = text.rindex(")")
    pid = int(text[:open_paren].strip())
    comm = text[open_paren + 1 : close_paren]
    rest = text[close_paren + 2 :].split()
    # rest[0] is field 3 (state); field N is rest[N - 3].
    return ProcStat(
        pid=pid,
        comm=comm,
        state=rest[0],
        ppid=int(rest[1]),
        pgid=int(rest[2]),
        sid=int(rest[3]),
        start_time=int(rest[19]),
        utime=int(rest[11]),
        stime=int(rest[12]),
        cutime=int(rest[13]),
        cstime=int(rest[14]),
    )


def read_stat(pid: int, proc: str = PROC) -> ProcStat | None:
    """The process's stat, or None when there is no such process (or it vanished mid-read)."""
    try:
        with open(f"{proc}/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return parse_stat(f.read())
    except (OSError, ValueError, IndexError):
        return None


@cache
def boot_id(proc: str = PROC) -> str:
    """This boot's id; a process recorded under another boot id is certainly gone."""
    with open(f"{proc}/sys/kernel/random/boot_id", encoding="ascii") as f:
        return f.read().strip()


def identify(pid: int, proc: str = PROC) -> ProcessIdentity | None:
    """The identity of the process that has ``pid`` right now, if any."""
    st = read_stat(pid, proc)
    if st is None:
        return None
    return ProcessIdentity(pid=pid, start_time=st.start_time, boot_id=boot_id(proc))


def is_same_process(record: ProcessIdentity, proc: str = PROC) -> bool:
    """True when ``record.pid`` is still the process the record was written for.

    A zombie still counts: it is the recorded process, not yet reaped, and its
    pid cannot have been reused.  Use ``is_running`` to ask whether it is alive.
    """
    if record.boot_id != boot_id(proc):
        return False
    st = read_stat(record.pid, proc)
    return st is not None and st.start_time == record.start_time


def is_running(record: ProcessIdentity, proc: str = PROC) -> bool:
    """The recorded process exists, is that process, and has not exited."""
    if record.boot_id != boot_id(proc):
        return False
    st = read_stat(record.pid, proc)
    return st is not None and st.start_time == record.start_time and st.state not in ("Z", "X")


def read_environ(pid: int, proc: str = PROC) -> dict[str, str] | None:
    """The environment a process was started with; None when unreadable (gone, another user)."""
    try:
        with open(f"{proc}/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        if b"=" in item:
            k, _, v = item.partition(b"=")
            env[k.decode("utf-8", "replace")] = v.decode("utf-8", "replace")
    return env


def read_cmdline(pid: int, proc: str = PROC) -> list[str] | None:
    """argv of a process; None when gone, [] for kernel threads and zombies."""
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0")[:-1]] if raw else []


def list_pids(proc: str = PROC) -> Iterator[int]:
    """Every pid currently in procfs (a snapshot; any may exit while you look)."""
    for name in os.listdir(proc):
        if name.isdigit():
            yield int(name)


def ancestors(pid: int | None = None, proc: str = PROC) -> set[int]:
    """``pid`` (default: this process) and every parent up to init.

    Nothing that scans for processes to kill may ever hit one of these.
    """
    out: set[int] = set()
    cur = os.getpid() if pid is None else pid
    while cur > 0 and cur not in out:
        out.add(cur)
        st = read_stat(cur, proc)
        if st is None:
            break
        cur = st.ppid
    return out
