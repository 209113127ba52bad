"""Fetch throughput: llmgw's weights fetcher against curl, same server, same file, one run.

    .venv/bin/python benchmarks/fetch/run.py            # 1 GiB, 5 rounds
    .venv/bin/python benchmarks/fetch/run.py --size-gib 2 --rounds 7

What is measured, and why this way:

* One file of ``--size-gib`` random bytes is served from tmpfs (/dev/shm) by
  ``server.py`` (aiohttp.web FileResponse: sendfile, Range, ETag) in its own
  process on 127.0.0.1.  Both clients download that same URL from that same
  server process.
* Each round runs curl, then llmgw's fetcher (``client.py``, a separate
  process as curl is), in alternating order, each into a fresh directory on
  tmpfs, so neither client is measured against disk write-back and the
  two see the same machine conditions.  The file is compared with the
  source after every download.
* Two times per download, both reported:
  - headline, the transfer: curl's own ``time_total`` against the time
    inside ``fetch_weights`` (first request to renamed, fsync'd file; fsync
    is cheap on tmpfs).  The agent is a long-running process that fetches
    with its interpreter and imports already loaded, so this is the time a
    download costs it;
  - a fresh process: the wall time of the whole client process as this
    script sees it (``subprocess.run`` start to exit), i.e. the transfer
    plus process start-up: for llmgw the Python interpreter and its imports
    (aiohttp, llmgw), for curl its (small) start-up.  This is what a
    one-shot command line tool would cost.
* The figures are ratios of medians (llmgw / curl), one for each time.  On
  a small shared machine single runs swing by 2x; medians of interleaved
  rounds are what can be compared.  A separate set of rounds with a declared
  sha256 shows what verification (reading the file back and hashing it) adds.
* Only plain HTTP with a Content-Length is measured, which the fetcher reads
  on its raw-socket path; https and chunked bodies go through aiohttp's
  body reader and are not measured here.

Results go to benchmarks/results/fetch.md and fetch.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results"
BLOCK = 16 << 20


def ensure_curl() -> str:
    """curl, installing the Debian package when it is absent (the benchmark's only setup)."""
    path = shutil.which("curl")
    if path:
        return path
    print("curl not found; installing the Debian package", flush=True)
    subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "curl"], check=True)
    path = shutil.which("curl")
    if not path:
        raise SystemExit("curl is still not on PATH after apt-get install")
    return path


def make_file(path: Path, size: int) -> str:
    """``size`` bytes that no layer can compress or deduplicate; returns its sha256."""
    h = hashlib.sha256()
    with open(path, "wb") as f:
        left = size
        while left:
            block = os.urandom(min(BLOCK, left))
            f.write(block)
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def same_file(a: Path, b: Path) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(BLOCK), fb.read(BLOCK)
            if x != y:
                return False
            if not x:
                return True


def run_curl(curl: str, url: str, out: Path) -> dict:
    target = out / "weights.bin"
    t0 = time.perf_counter()
    res = subprocess.run([curl, "-sS", "--fail", "-o", str(target), "-w", "%{time_total} %{size_download}", url],
                         capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    seconds, size = res.stdout.split()
    return {"seconds": float(seconds), "bytes": int(size), "wall": wall, "path": str(target)}


def run_llmgw(url: str, out: Path, sha256: str | None = None) -> dict:
    argv = [sys.executable, str(HERE / "client.py"), url, str(out)] + (["--sha256", sha256] if sha256 else [])
    t0 = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    return {"seconds": doc["seconds"], "bytes": doc["bytes"], "wall": wall, "path": doc["path"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--verify-rounds", type=int, default=2, help="extra llmgw rounds with a declared sha256")
    ap.add_argument("--work", type=Path, default=Path("/dev/shm/llmgw-fetch-bench"))
    ap.add_argument("--results", type=Path, default=RESULTS)
    a = ap.parse_args()

    curl = ensure_curl()
    curl_version = subprocess.run([curl, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    size = int(a.size_gib * (1 << 30))
    shutil.rmtree(a.work, ignore_errors=True)
    (a.work / "src").mkdir(parents=True)
    src = a.work / "src" / "weights.bin"
    print(f"writing {size} random bytes to {src}", flush=True)
    digest = make_file(src, size)

    server = subprocess.Popen([sys.executable, str(HERE / "server.py"), str(a.work / "src")],
                              stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()  # type: ignore[union-attr]
        if not line.startswith("listening "):
            raise SystemExit(f"server did not start: {line!r}")
        url = f"http://127.0.0.1:{int(line.split()[1])}/weights.bin"
        rows: list[dict] = []
        for i in range(a.rounds):
            order = ("curl", "llmgw") if i % 2 == 0 else ("llmgw", "curl")
            for who in order:
                out = a.work / f"out-{who}-{i}"
                out.mkdir()
                r = run_curl(curl, url, out) if who == "curl" else run_llmgw(url, out)
                if r["bytes"] != size or not same_file(Path(r["path"]), src):
                    raise SystemExit(f"{who} round {i}: downloaded file differs from the source")
                r.update(client=who, round=i, mib_s=size / r["seconds"] / (1 << 20))
                del r["path"]
                rows.append(r)
                print(f"round {i} {who:5s} {r['mib_s']:8.0f} MiB/s  ({r['seconds']:.2f}s, process {r['wall']:.2f}s)",
                      flush=True)
                shutil.rmtree(out)
        for i in range(a.verify_rounds):
            out = a.work / f"out-verify-{i}"
            out.mkdir()
            r = run_llmgw(url, out, sha256=digest)
            r.update(client="llmgw+sha256", round=i, mib_s=size / r["seconds"] / (1 << 20))
            del r["path"]
            rows.append(r)
            print(f"verify {i} llmgw+sha256 {r['mib_s']:8.0f} MiB/s  ({r['seconds']:.2f}s)", flush=True)
            shutil.rmtree(out)
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(a.work, ignore_errors=True)

    def med(who: str, key: str = "mib_s") -> float | None:
        xs = [r[key] for r in rows if r["client"] == who]
        return statistics.median(xs) if xs else None

    for r in rows:
        r["wall_mib_s"] = size / r["wall"] / (1 << 20)
        r["startup"] = r["wall"] - r["seconds"]
    curl_m, ours_m, ver_m = med("curl"), med("llmgw"), med("llmgw+sha256")
    ratio = ours_m / curl_m  # type: ignore[operator]
    curl_w, ours_w = med("curl", "wall_mib_s"), med("llmgw", "wall_mib_s")
    wall_ratio = ours_w / curl_w  # type: ignore[operator]
    summary = {
        "size_bytes": size, "rounds": a.rounds,
        "metric": "transfer: curl time_total vs time inside fetch_weights (headline)",
        "curl_median_mib_s": round(curl_m, 1),  # type: ignore[arg-type]
        "llmgw_median_mib_s": round(ours_m, 1), "ratio_llmgw_to_curl": round(ratio, 3),  # type: ignore[arg-type]
        "llmgw_sha256_median_mib_s": None if ver_m is None else round(ver_m, 1),
        "target_ratio": 0.9, "meets_target": ratio >= 0.9,
        "fresh_process": {
            "metric": "wall time of a fresh client process (start-up + imports + transfer), both clients",
            "curl_median_mib_s": round(curl_w, 1), "llmgw_median_mib_s": round(ours_w, 1),  # type: ignore[arg-type]
            "ratio_llmgw_to_curl": round(wall_ratio, 3),
            "curl_median_seconds": round(med("curl", "wall"), 3),  # type: ignore[arg-type]
            "llmgw_median_seconds": round(med("llmgw", "wall"), 3),  # type: ignore[arg-type]
            "curl_median_startup_seconds": round(med("curl", "startup"), 3),  # type: ignore[arg-type]
            "llmgw_median_startup_seconds": round(med("llmgw", "startup"), 3),  # type: ignore[arg-type]
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release(),
                    "curl": curl_version},
        "runs": rows,
    }
    a.results.mkdir(parents=True, exist_ok=True)
    (a.results / "fetch.json").write_text(json.dumps(summary, indent=1) + "\n")
    (a.results / "fetch.md").write_text(render(summary))
    print(f"transfer: curl median {curl_m:.0f} MiB/s, llmgw median {ours_m:.0f} MiB/s: ratio {ratio:.2f} "
          f"(target >= 0.9: {'met' if ratio >= 0.9 else 'NOT met'})")
    print(f"fresh process wall: curl median {curl_w:.0f} MiB/s, llmgw median {ours_w:.0f} MiB/s: "
          f"ratio {wall_ratio:.2f}")
    return 0


def render(s: dict) -> str:
    rows = "\n".join(f"| {r['round']} | {r['client']} | {r['mib_s']:.0f} | {r['seconds']:.2f} | {r['wall']:.2f} | "
                     f"{r['wall_mib_s']:.0f} |" for r in s["runs"])
    m, w = s["machine"], s["fresh_process"]
    ver = "-" if s["llmgw_sha256_median_mib_s"] is None else f"{s['llmgw_sha256_median_mib_s']:.0f}"
    return f"""# Weights fetch throughput: llmgw vs curl

Command: `.venv/bin/python benchmarks/fetch/run.py --size-gib {s['size_bytes'] / (1 << 30):g} --rounds {s['rounds']}`

One file of {s['size_bytes'] / (1 << 30):g} GiB of random bytes on tmpfs, served over 127.0.0.1 by one
aiohttp.web process (sendfile); curl and llmgw's fetcher (`llmgw.agent.fetch`, run by
`benchmarks/fetch/client.py` as its own process) download it from that same server, alternating
order per round, each into a fresh tmpfs directory; every download is compared with the source.
Plain HTTP with a Content-Length only (the fetcher's raw-socket path): https and chunked
bodies take aiohttp's body reader and are not measured here.

Two times are taken for every download, and both are reported:

- **Transfer (the headline and the target).** curl's own `time_total` against the time
  inside `fetch_weights`, from its first request to the renamed, fsync'd file. The agent is
  a long-running process: its interpreter and imports are loaded once, at agent start, not
  per download, so this is what a download costs it.
- **Fresh process.** The wall time of the whole client process, from `subprocess.run` to
  its exit: the transfer plus start-up. For llmgw that is a Python interpreter importing
  aiohttp and llmgw; curl starts in milliseconds. This is what a one-shot command would cost,
  and it is *not* how the agent downloads.

| | curl median | llmgw median | ratio llmgw / curl |
|---|---|---|---|
| **transfer** (MiB/s) | {s['curl_median_mib_s']:.0f} | {s['llmgw_median_mib_s']:.0f} | **{s['ratio_llmgw_to_curl']:.2f}** (target >= {s['target_ratio']}: {'met' if s['meets_target'] else 'NOT met'}) |
| fresh process, wall (MiB/s) | {w['curl_median_mib_s']:.0f} | {w['llmgw_median_mib_s']:.0f} | {w['ratio_llmgw_to_curl']:.2f} |
| fresh process, wall (s) | {w['curl_median_seconds']:.2f} | {w['llmgw_median_seconds']:.2f} | |
| start-up = wall - transfer (s) | {w['curl_median_startup_seconds']:.2f} | {w['llmgw_median_startup_seconds']:.2f} | |

llmgw fetch with sha256 declared (transfer, MiB/s): {ver}.

Machine: {m['cpus']} CPUs (shared with other work while this ran), Python {m['python']},
kernel {m['kernel']}, {m['curl']}.

How to read it: on loopback the server and the client share the same {m['cpus']} cores, so
both numbers are CPU-bound, not network-bound, and single runs vary a lot on a shared machine;
compare the medians. With sha256 declared the file is read back and hashed before it is
renamed (what is verified is what is on disk), which costs one extra pass over the file.

| round | client | transfer MiB/s | transfer s | process wall s | process wall MiB/s |
|---|---|---|---|---|---|
{rows}
"""


if __name__ == "__main__":
    sys.exit(main())
