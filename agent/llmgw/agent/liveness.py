"""Is a Ready shard still serving?  The judgement, without I/O.

Ready is not forever: a vLLM engine core stuck in an NCCL collective keeps
its API server answering ``/health`` with 200 (it only checks that the core
has not *errored*) while nothing is generated; an API server whose loop is
stuck answers nothing; a dead engine core turns ``/health`` into 500.  Only
the last two show on ``/health``, so one check is:

* ``/health`` answers 200 within the check's timeout, and
* when requests are pending (running or waiting, from the engine's own
  gauges), the engine's step counters moved since the previous check, which
  also had requests pending (an engine that is busy makes steps; one that is
  idle has nothing to show).  vLLM's ``vllm:iteration_tokens_total``
  histogram, SGLang's and llama.cpp's token counters serve;
* without readable metrics, a one-token completion stands in for progress.

One failed check proves little (a GC pause, a long prefill chunk), so a shard
is failed only when no check has passed for ``fail_after`` seconds and at
least two in a row failed.  Ranks > 0 serve no HTTP: their check is that the
process runs (not exited, not stopped, not a zombie).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from llmgw.enginesignals import NAMES, QUEUE_DEPTH
from llmgw.settings import LivenessPolicy

_WAITING = NAMES[QUEUE_DEPTH]  # the requests an engine holds waiting: the queue-depth signal's gauges
# Per engine: gauges whose sum is "requests pending", counters whose sum moves
# with every engine step.  Names as each engine exposes them on /metrics.
PENDING = {
    "vllm": ("vllm:num_requests_running", *_WAITING["vllm"]),
    "sglang": ("sglang:num_running_reqs", *_WAITING["sglang"]),
    "llamacpp": ("llamacpp:requests_processing", *_WAITING["llamacpp"]),
}
PROGRESS = {
    "vllm": ("vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total_sum",
             "vllm:prompt_tokens_total", "vllm:generation_tokens_total"),
    "sglang": ("sglang:prompt_tokens_total", "sglang:generation_tokens_total"),
    "llamacpp": ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total"),
}
# every name the judgement reads, whatever the engine: all a page is read for
READ = frozenset(n for by_engine in (PENDING, PROGRESS) for names in by_engine.values() for n in names)


@dataclass(frozen=True)
class Progress:
    """What one read of the engine's metrics says."""

    pending: float  # requests running + waiting
    steps: float  # sum of the step counters (only its movement matters)


@dataclass(frozen=True)
class Check:
    """One check's outcome."""

    ok: bool
    detail: str  # "ok" or what failed, for the failure reason
    progress: Progress | None = None


@dataclass(frozen=True)
class Liveness:
    """The judgement so far for one shard."""

    last_ok: float  # monotonic time of the last passing check (or of Ready)
    failures: int = 0  # failed checks in a row
    progress: Progress | None = None  # the last metrics read, to compare the next one with


def progress_from_samples(samples: Mapping[str, float], engine: str) -> Progress | None:
    """Pending requests and step counters from ``/metrics`` samples; None when the engine shows neither."""
    for name in [engine, *(e for e in PENDING if e != engine)]:  # the engine's own names first
        pending_names, step_names = PENDING.get(name, ()), PROGRESS.get(name, ())
        if any(n in samples for n in pending_names) and any(n in samples for n in step_names):
            return Progress(pending=sum(samples.get(n, 0.0) for n in pending_names),
                            steps=sum(samples.get(n, 0.0) for n in step_names))
    return None


def stalled(before: Progress | None, now: Progress) -> bool:
    """Requests pending at both reads and not one engine step between them."""
    return before is not None and before.pending > 0 and now.pending > 0 and now.steps == before.steps


def judge_engine(health_ok: bool, health_detail: str, before: Progress | None,
                 now: Progress | None) -> Check:
    """One rank-0 check from its ``/health`` answer and two metrics reads."""
    if not health_ok:
        return Check(False, health_detail, now)
    if now is not None and stalled(before, now):
        return Check(False, f"{now.pending:g} request(s) pending and no engine step since the last check "
                            f"(step counters stuck at {now.steps:g})", now)
    return Check(True, "ok", now)


def judge_process(state: str | None) -> Check:
    """A rank > 0 check from its process state letter (``/proc/PID/stat``); None: gone."""
    if state is None or state in ("Z", "X", "x"):
        return Check(False, "process is gone")
    if state in ("T", "t"):
        return Check(False, "process is stopped (signal or tracer)")
    return Check(True, "ok")


def observe(prev: Liveness, check: Check, now: float, policy: LivenessPolicy) -> tuple[Liveness, str | None]:
    """Fold one check into the judgement; the second value is the failure reason once failed."""
    progress = check.progress if check.progress is not None else prev.progress
    if check.ok:
        return Liveness(last_ok=now, failures=0, progress=progress), None
    state = Liveness(last_ok=prev.last_ok, failures=prev.failures + 1, progress=progress)
    silent = now - prev.last_ok
    if state.failures >= 2 and silent >= policy.fail_after:
        return state, (f"not live: no passing health check for {silent:.0f}s (fail_after "
                       f"{policy.fail_after:g}s, {state.failures} failed in a row); last: {check.detail}")
    return state, None
