"""The simulator's timing model, its fit to measurements, and named presets of fitted figures.

The model (applied in ``sim_http``): the first token comes after
``prefill_token_latency x (prompt tokens not in the prefix cache)`` plus one decode step, and
each token after ``token_latency x (1 + decode_batch_slowdown x (running - 1))``.  Both halves
are linear, so ``benchmarks/simfit/run.py`` fits them to a real engine by ordinary least
squares: time to first token against uncached prompt tokens (slope = prefill seconds per
token), and inter-token time against ``batch - 1`` (intercept = token latency alone,
slope / intercept = the batch slowdown).

A preset names figures fitted that way, so an operator or a test selects them with
``LLMGW_SIM_TIMING=<name>`` instead of copying numbers; any ``LLMGW_SIM_*`` knob set
explicitly beside it wins.  Each preset says where its figures came from: they describe that
engine, model and machine only (docs/testing.md, "Timing model").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence


@dataclass(frozen=True)
class Preset:
    knobs: Mapping[str, str]  # LLMGW_SIM_* variable -> value
    source: str  # the engine, model and machine the figures were fitted to


PRESETS: dict[str, Preset] = {
    # benchmarks/results/simfit.md: each point the median of 5 repeats on a shared 2-core machine
    "vllm-cpu-tiny": Preset(
        knobs={"LLMGW_SIM_PREFILL_TOKEN_LATENCY": "3.4e-05", "LLMGW_SIM_TOKEN_LATENCY": "0.00198",
               "LLMGW_SIM_DECODE_BATCH_SLOWDOWN": "0.0349"},
        source="vllm-cpu 0.32.0 (float32, one OpenMP thread, block size 32, prefix caching) serving the random "
               "2-layer Llama of tests/engines/tinyhf.py on an Intel Xeon (2 shared cores); not a GPU",
    ),
}


def expand(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with ``LLMGW_SIM_TIMING``'s preset filled in under the knobs set explicitly.

    Raises ValueError naming the known presets for an unknown name."""
    name = (env.get("LLMGW_SIM_TIMING") or "").strip()
    if not name or name == "none":
        return dict(env)
    preset = PRESETS.get(name)
    if preset is None:
        known = ", ".join(sorted(PRESETS)) or "(none)"
        raise ValueError(f"LLMGW_SIM_TIMING={name!r}: unknown preset; known: {known}")
    out = dict(env)
    for key, value in preset.knobs.items():
        if (out.get(key) or "").strip() == "":
            out[key] = value
    return out


def ttft(prefill_token_latency: float, token_latency: float, uncached_tokens: int) -> float:
    """The model's time to first token: prefill of the uncached tokens, then one decode step."""
    return prefill_token_latency * uncached_tokens + token_latency


def inter_token(token_latency: float, decode_batch_slowdown: float, batch: int) -> float:
    """The model's seconds per token with ``batch`` requests running."""
    return token_latency * (1.0 + decode_batch_slowdown * max(batch - 1, 0))


def least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of the ordinary least-squares line through the points."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError("a line needs points at two or more distinct x")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx
    return my - slope * mx, slope


@dataclass(frozen=True)
class Fit:
    prefill_token_latency: float  # seconds per uncached prompt token
    prefill_intercept: float  # seconds of TTFT at zero prompt tokens (request overhead + one step)
    token_latency: float  # seconds per token, one request alone
    decode_batch_slowdown: float  # fraction added per other running request

    def knobs(self) -> dict[str, str]:
        return {"LLMGW_SIM_PREFILL_TOKEN_LATENCY": f"{self.prefill_token_latency:.3g}",
                "LLMGW_SIM_TOKEN_LATENCY": f"{self.token_latency:.3g}",
                "LLMGW_SIM_DECODE_BATCH_SLOWDOWN": f"{self.decode_batch_slowdown:.3g}"}


def fit(prefill: Sequence[tuple[int, float]], decode: Sequence[tuple[int, float]]) -> Fit:
    """Fit the model to (uncached prompt tokens, TTFT seconds) and (batch, inter-token seconds)
    samples, every repeat a point. Negative slopes (noise on a flat curve) clamp to 0."""
    p0, p = least_squares([float(n) for n, _ in prefill], [t for _, t in prefill])
    d0, d = least_squares([float(b - 1) for b, _ in decode], [t for _, t in decode])
    if d0 <= 0:
        raise ValueError(f"inter-token intercept {d0:g} s is not positive: the decode samples do not fit a line")
    return Fit(prefill_token_latency=max(p, 0.0), prefill_intercept=p0, token_latency=d0,
               decode_batch_slowdown=max(d / d0, 0.0))
