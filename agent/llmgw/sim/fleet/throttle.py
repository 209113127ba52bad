"""Hold a process to a share of one CPU: the control plane under contention, without cgroups.

    python -m llmgw.sim.fleet.throttle --pid 1234 --share 0.5 [--period 0.1]

A duty cycle of SIGCONT and SIGSTOP: the process runs for ``share x
period`` and is stopped for the rest of each period, so it gets at most
``share`` of a core however idle the machine is, as on a host where other
work takes the rest.  Pinning beside a busy loop needs a spare CPU, and
cgroups need privileges a test or a shared benchmark host may not have.

The stops are short (``period`` at most) and regular: the control plane
sees its event loop run late, which is what contention looks like to it.
On SIGTERM, SIGINT or the process's exit the throttle leaves it running.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time


class Throttle:
    """A thread that duty-cycles ``pid``; ``stop`` leaves it running (SIGCONT)."""

    def __init__(self, pid: int, share: float, period: float = 0.1):
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.pid, self.share, self.period = pid, share, period
        self.cycles = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"throttle {pid}", daemon=True)

    def start(self) -> "Throttle":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _signal(self, sig: int) -> bool:
        try:
            os.kill(self.pid, sig)
            return True
        except ProcessLookupError:
            return False

    def _run(self) -> None:
        on, off = self.share * self.period, (1 - self.share) * self.period
        try:
            while not self._done.is_set():
                if off > 0:
                    if not self._signal(signal.SIGSTOP):
                        return
                    time.sleep(off)
                if not self._signal(signal.SIGCONT):
                    return
                self.cycles += 1
                self._done.wait(on)
        finally:
            self._signal(signal.SIGCONT)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmgw.sim.fleet.throttle", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--share", type=float, required=True, help="share of one CPU, in (0, 1]")
    ap.add_argument("--period", type=float, default=0.1, help="seconds per run/stop cycle (default 0.1)")
    args = ap.parse_args(argv)
    t = Throttle(args.pid, args.share, args.period)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    t.start()
    while not done.is_set() and t._thread.is_alive():
        done.wait(0.5)
    t.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
