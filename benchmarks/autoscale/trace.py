"""A two-model diurnal request trace in Mooncake's JSONL shape, generated, seeded.

    python benchmarks/autoscale/trace.py [--seed 1] [--day 14400] [--out trace.jsonl]

Shape of a line: Mooncake's public traces (kvcache-ai/Mooncake, ``FAST25-release/traces``,
the conversation and tool-agent traces of Kimi's service) are JSONL, one request a line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [...]}

``timestamp`` in milliseconds since the first request, lengths in tokens.  Lines here keep
those three keys and add ``model`` (which of the two deployments the request is for); they
carry no ``hash_ids``, because the replay does not model the prefix cache.  A reader of
Mooncake's format that ignores unknown keys reads them as they are.

Why generated: the published traces cover a stretch of one service, one model, not a day
of two, and the autoscaling question is what a day's curve does to a fixed pool shared by
two models.  So the lengths imitate the two published kinds (long prompts, short answers)
and the arrival rate is imposed:

- ``chat`` (like the conversation trace): input lognormal, median 3,000 tokens, sigma 0.9;
  output lognormal, median 250, sigma 0.7.  Busiest at 14:00.
- ``agent`` (like the tool-agent trace): input median 6,000, sigma 0.7; output median 120,
  sigma 0.6.  Busiest at 00:00 (a batch / other-region load, ten hours off ``chat``).
- Inputs are clipped to 16..32,000 tokens, outputs to 1..2,000.

The daily curve of each model: ``rate = peak x (trough + (1 - trough) x c(h) ** 2)`` with
``c(h) = (1 + cos(2 pi (h - busiest) / 24)) / 2`` over the hour of the day ``h``: a
trough of ``trough`` (0.15) of the peak for the night, a rise over about six hours, a
rounded peak.  Each simulated minute's rate is further multiplied by a lognormal factor
(sigma 0.1) so minutes are not all alike, and arrivals within it are Poisson (drawn by
thinning).  A whole day is compressed into ``day`` simulated seconds (default 14,400:
four hours), starting at 07:00, so every ramp is six times steeper than a real day's: harder on a rule whose
replicas take a fixed time to start, not easier.

Same seed, same trace, byte for byte.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelLoad:
    name: str
    peak_rps: float  # requests per second at the busiest hour (before the per-minute factor)
    busiest_hour: float  # hour of the (24-hour) day the curve peaks at
    input_median: float
    input_sigma: float
    output_median: float
    output_sigma: float
    trough: float = 0.15  # the night's rate as a fraction of the peak


INPUT_CLIP = (16, 32_000)
OUTPUT_CLIP = (1, 2_000)
MINUTE_SIGMA = 0.1
# The trace starts at 07:00, when both models are near their quietest (about a quarter of
# their peaks), so the replay's first minutes are not a cold start into one model's peak.
START_HOUR = 7.0


def default_models(peak_rps: float = 30.0) -> tuple[ModelLoad, ModelLoad]:
    return (ModelLoad("chat", peak_rps, 14.0, 3000, 0.9, 250, 0.7),
            ModelLoad("agent", peak_rps, 0.0, 6000, 0.7, 120, 0.6))


def daily_factor(load: ModelLoad, hour: float) -> float:
    """The curve's value (trough..1) at ``hour`` of the day."""
    c = (1.0 + math.cos(2.0 * math.pi * (hour - load.busiest_hour) / 24.0)) / 2.0
    return load.trough + (1.0 - load.trough) * c * c


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(round(median * math.exp(rng.gauss(0.0, sigma))))))


def generate(models: tuple[ModelLoad, ...], day: float, seed: int, duration: float | None = None,
             start_hour: float = START_HOUR) -> list[dict]:
    """The merged trace of ``models`` over ``duration`` simulated seconds (default one day)
    from ``start_hour`` of the day, sorted by timestamp; each model draws from its own
    stream so adding one changes no other."""
    duration = day if duration is None else duration
    out: list[tuple[int, int, dict]] = []
    for m_index, load in enumerate(models):
        rng = random.Random(f"{seed}:{load.name}")
        minutes = int(math.ceil(duration / 60.0))
        minute_factor = [math.exp(rng.gauss(0.0, MINUTE_SIGMA)) for _ in range(minutes)]
        rmax = load.peak_rps * max(minute_factor)
        t = 0.0
        while True:
            t += rng.expovariate(rmax)
            if t >= duration:
                break
            hour = (start_hour + 24.0 * t / day) % 24.0
            rate = load.peak_rps * daily_factor(load, hour) * minute_factor[int(t // 60.0)]
            if rng.random() * rmax >= rate:
                continue  # thinning: keeps each arrival with probability rate / rmax
            line = {"timestamp": int(t * 1000.0),
                    "input_length": _lognormal(rng, load.input_median, load.input_sigma, *INPUT_CLIP),
                    "output_length": _lognormal(rng, load.output_median, load.output_sigma, *OUTPUT_CLIP),
                    "model": load.name}
            out.append((line["timestamp"], m_index, line))
    out.sort(key=lambda x: (x[0], x[1]))
    return [line for _, _, line in out]


def read_jsonl(path: str) -> list[dict]:
    """A Mooncake-shaped JSONL file (a line without ``model`` is for the first model, ``chat``)."""
    lines = []
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            d = json.loads(raw)
            try:
                lines.append({"timestamp": int(d["timestamp"]), "input_length": int(d["input_length"]),
                              "output_length": int(d["output_length"]), "model": str(d.get("model", "chat"))})
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{n}: not a Mooncake trace line ({e!r})") from None
    lines.sort(key=lambda d: d["timestamp"])
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--day", type=float, default=14_400.0, help="simulated seconds a day is compressed to")
    ap.add_argument("--peak-rps", type=float, default=30.0, help="each model's requests per second at its peak")
    ap.add_argument("--out", default="-", help="JSONL file to write (default stdout)")
    args = ap.parse_args(argv)
    lines = generate(default_models(args.peak_rps), args.day, args.seed)
    f = sys.stdout if args.out == "-" else open(args.out, "w", encoding="utf-8")
    try:
        for line in lines:
            f.write(json.dumps(line, separators=(", ", ": ")) + "\n")
    finally:
        if f is not sys.stdout:
            f.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
