"""What every test suite and the benchmarks share, imported as a package (``tests.support``).

- ``polling``: wait on a condition, never sleep-and-hope (``until``, ``until_async``, ``run_async``);
- ``ports``: loopback ports (``free_port``, ``closed_port``);
- ``procfs``: what ``/proc`` says about a process (start time, state, CPU, memory, its tree);
- ``fleetclient``: an HTTP client for a control plane's admin API over mutual TLS;
- ``logs``: tracebacks in a process's log.

This package is the bottom layer: it imports llmgw and third-party libraries,
never a test module, a suite's helpers or a benchmark, so the suites and the
benchmarks can both import it without an import loop.
"""
