"""What ``/proc`` says about a process: identity, state, CPU time, memory, environment, its descendants.

The ``/proc/<pid>/stat`` line is parsed once, by the agent's own parser
(``llmgw.agent.procident.parse_stat``: the command name may hold spaces and
parentheses); every reader here is a view of it.  A process that is gone (or
vanished mid-read) reads as None, never as an exception.
"""

from __future__ import annotations

import os
from pathlib import Path

from llmgw.agent.procident import ProcStat, read_stat

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def stat(pid: int | str) -> ProcStat | None:
    """``/proc/<pid>/stat`` parsed (``pid`` may be ``"self"``); None when there is no such process."""
    return read_stat(pid)  # type: ignore[arg-type]


def start_time(pid: int) -> int | None:
    """Field 22 (clock ticks after boot): with the pid, a process's identity."""
    st = read_stat(pid)
    return None if st is None else st.start_time


def state(pid: int) -> str | None:
    """The state letter (R, S, D, Z, T, ...); None when there is no such process."""
    st = read_stat(pid)
    return None if st is None else st.state


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (or a dead task) has exited, though ``kill(pid, 0)`` still succeeds."""
    return state(pid) not in (None, "Z", "X", "x")


def cpu_seconds(pid: int | str = "self", children: bool = False) -> float | None:
    """User + system time of ``pid`` (``children``: plus its reaped children's); None once it is gone."""
    st = stat(pid)
    if st is None:
        return None
    return (st.cpu_ticks + (st.cutime + st.cstime if children else 0)) / CLK_TCK


def argv(pid: int) -> list[str]:
    """The command line ``pid`` runs (``/proc/<pid>/cmdline``)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def environ(pid: int) -> dict[str, str] | None:
    """The environment ``pid`` was started with (``/proc/<pid>/environ``); None when there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="surrogateescape")
    except OSError:
        return None
    return dict(e.split("=", 1) for e in raw.split("\0") if "=" in e)


def live() -> dict[int, ProcStat]:
    """Every process this namespace shows, by pid (those that exit mid-scan left out)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = read_stat(int(entry))
            if st is not None:
                out[st.pid] = st
    return out


def descendants(root: int, parents: dict[int, int]) -> set[int]:
    """``root`` and its descendants, given every live process's parent."""
    members = {root}
    changed = True
    while changed:
        changed = False
        for pid, ppid in parents.items():
            if ppid in members and pid not in members:
                members.add(pid)
                changed = True
    return members


def tree_pids(root: int) -> set[int]:
    """``root`` and every live descendant."""
    return descendants(root, {pid: st.ppid for pid, st in live().items()})


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds of ``root`` and every live descendant, reaped children included (cutime, cstime)."""
    stats = live()
    members = descendants(root, {pid: st.ppid for pid, st in stats.items()})
    return sum(stats[p].cpu_ticks + stats[p].cutime + stats[p].cstime for p in members if p in stats) / CLK_TCK


def rss_kib(pid: int) -> int:
    """Resident set size in KiB (``VmRSS`` of ``/proc/<pid>/status``)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def rss_bytes(pid: int) -> int:
    """Resident set size in bytes (``/proc/<pid>/statm``, one read, no line scan)."""
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE


def processes_under(root: Path | str, environ: bool = False) -> list[int]:
    """Pids whose command line (or, with ``environ``, environment) names ``root``: what a test
    installed and started there. etcd takes its settings from its environment, hence ``environ``."""
    needle = str(root).encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            found = needle in (entry / "cmdline").read_bytes() or (
                environ and needle in (entry / "environ").read_bytes())
        except OSError:
            continue
        if found:
            pids.append(int(entry.name))
    return pids


def tcp_clients_of(port: int) -> list[str]:
    """The local IPv4 address of every established connection to ``port`` (``/proc/net/tcp``): where
    this namespace's clients of a local server dial from, one entry per connection."""
    out = []
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            local, remote, state = line.split()[1:4]
            if state == "01" and int(remote.split(":")[1], 16) == port:
                raw = bytes.fromhex(local.split(":")[0])[::-1]  # little-endian on the hosts we run on
                out.append(".".join(str(b) for b in raw))
    return out
