"""Start the engine simulator as a real subprocess and wait until it serves.

    from simproc import start_sim

    with start_sim(model="m", env={"LLMGW_SIM_TOKEN_LATENCY": "0.01"}) as sim:
        client = openai.OpenAI(base_url=sim.base_url, api_key="unused")
        ...

``start_sim`` picks a free loopback port (bind to port 0, close), launches
``python -m llmgw.sim.engine serve MODEL --host 127.0.0.1 --port P ...`` with
the given LLMGW_SIM_* environment, and polls GET /health until it answers 200,
the process exits (SimStartError with its output) or ``timeout`` passes.  A
port taken in the gap between choosing and binding is retried with another.
Output goes to a file, never a pipe, so a chatty simulator cannot block.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from tests.support.ports import free_port

HOST = "127.0.0.1"


class SimStartError(RuntimeError):
    def __init__(self, message: str, returncode: int | None, output: str) -> None:
        super().__init__(f"{message}\n--- simulator output ---\n{output}")
        self.returncode = returncode
        self.output = output


def sim_command(dialect_args: Sequence[str]) -> list[str]:
    """The command that runs the simulator with ``dialect_args`` (e.g. ["serve", "m", ...])."""
    return [sys.executable, "-m", "llmgw.sim.engine", *dialect_args]


@dataclass
class SimProcess:
    proc: subprocess.Popen
    port: int
    host: str = HOST
    log_path: Path = field(default_factory=Path)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``.../v1``)."""
        return f"{self.url}/v1"

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def health_status(self, timeout: float = 2.0) -> int | None:
        """GET /health status, or None when nothing answers."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except (OSError, urllib.error.URLError):
            return None

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SimStartError("simulator exited before it was healthy",
                                    self.proc.returncode, self.output())
            if self.health_status() == 200:
                return
            time.sleep(0.05)
        raise SimStartError(f"simulator not healthy after {timeout}s", None, self.output())

    def wait_output(self, text: str, timeout: float = 60.0) -> None:
        """Wait until ``text`` appears in the simulator's output."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.output():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise SimStartError(f"{text!r} never appeared in the output", self.proc.poll(), self.output())

    def wait(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout)
        return self.proc.returncode

    def __enter__(self) -> "SimProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _launch(args: list[str], env: Mapping[str, str] | None, port: int, log_dir: Path) -> SimProcess:
    log_path = log_dir / f"sim-{port}-{time.monotonic_ns()}.log"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_SIM_")}
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env.update(env or {})
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            sim_command(args), stdout=log, stderr=subprocess.STDOUT, env=full_env,
            stdin=subprocess.DEVNULL,
        )
    return SimProcess(proc=proc, port=port, log_path=log_path)


def start_sim(
    model: str = "m",
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    *,
    wait: bool = True,
    timeout: float = 60.0,
    log_dir: str | os.PathLike | None = None,
) -> SimProcess:
    """Start ``llmgw-engine-sim serve MODEL --host 127.0.0.1 --port P *extra_args``.

    ``wait=False`` returns at once (for start-up faults and delays); otherwise
    returns once /health answers 200.
    """
    log_root = Path(log_dir or tempfile.mkdtemp(prefix="llmgw-sim-"))
    attempts = 1 if port is not None else 3
    last: SimStartError | None = None
    for _ in range(attempts):
        chosen = port if port is not None else free_port()
        args = ["serve", model, "--host", HOST, "--port", str(chosen), *extra_args]
        sim = _launch(args, env, chosen, log_root)
        if not wait:
            return sim
        try:
            sim.wait_healthy(timeout)
            return sim
        except SimStartError as e:
            sim.stop()
            last = e
            if "Address already in use" not in e.output:
                raise
    assert last is not None
    raise last


def start_sim_argv(
    argv: Sequence[str],
    port: int,
    env: Mapping[str, str] | None = None,
    *,
    wait: bool = True,
    timeout: float = 60.0,
    log_dir: str | os.PathLike | None = None,
) -> SimProcess:
    """Start the simulator with a full dialect argv (as an adapter built it, minus the binary)."""
    log_root = Path(log_dir or tempfile.mkdtemp(prefix="llmgw-sim-"))
    sim = _launch(list(argv), env, port, log_root)
    if wait:
        try:
            sim.wait_healthy(timeout)
        except SimStartError:
            sim.stop()
            raise
    return sim
