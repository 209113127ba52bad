"""A lower CPU priority for a test's whole process tree, processes in sessions of their own included.

Niceness is per task, but where the kernel groups tasks by session (``sched_autogroup_enabled``,
on by default in Debian's kernels) the CPU is first shared out between those groups, and only
within a group by niceness. A process that calls ``setsid()``, as the agent does for every engine
it starts, gets a group of its own at niceness 0, whatever its task niceness: a test niced to
yield the CPU still had its vLLM engines take it from everything else, while its own control
plane, niced in the test runner's group, starved (its event loop did not run for 15.8 s, and a
TLS handshake that waited on it was aborted at its deadline). The group's weight is set by
writing a niceness to ``/proc/<pid>/autogroup``; ``SessionNicer`` does that for each session
leader the tree gains, as it appears.
"""

from __future__ import annotations

import threading
from pathlib import Path

from tests.support.procfs import descendants, live


def autogroup_nice(pid: int) -> int | None:
    """The niceness of ``pid``'s autogroup; None without autogroups (or without the process)."""
    try:
        return int(Path(f"/proc/{pid}/autogroup").read_text().rsplit("nice", 1)[1])
    except (OSError, ValueError, IndexError):
        return None


def set_autogroup_nice(pid: int, nice: int) -> bool:
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:
        return False
    return True


class SessionNicer:
    """While running, sets the autogroup niceness of every session leader below ``root`` to ``nice``.

    Polled every ``period`` seconds: an engine spends its first moments at its session's default
    weight, which costs nothing next to the minute a real engine takes to start."""

    def __init__(self, root: int, nice: int, period: float = 0.5) -> None:
        self.root = root
        self.nice = nice
        self.period = period
        self.niced: set[tuple[int, int]] = set()  # (pid, start time): a reused pid is a new process
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="session-nicer", daemon=True)

    def scan(self) -> None:
        stats = live()
        for pid in descendants(self.root, {p: st.ppid for p, st in stats.items()}):
            st = stats.get(pid)
            if st is None or st.sid != pid or (pid, st.start_time) in self.niced:
                continue
            if set_autogroup_nice(pid, self.nice):
                self.niced.add((pid, st.start_time))

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.scan()

    def __enter__(self) -> SessionNicer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
