"""Regenerate the inventory plugin's goldens (and, with --record, the recorded API answers).

    .venv/bin/python tests/inventory/regenerate.py           # goldens from tests/inventory/recorded/
    .venv/bin/python tests/inventory/regenerate.py --record  # first record a live fleet's API again

The recording is a real fleet (control plane, two agents, engine simulators):
``tiny`` with two Ready replicas, one node whose second InfiniBand adapter is in
INIT (no subnet manager), and a ``big`` deployment asking for four GPUs that no
node has, so the catalog, the unplaced slot and the placement explanation are
all in it. Review the diff of the goldens before committing them: they are what
the tests hold the plugin to.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "integration"), str(HERE.parent.parent)]  # ..., tests.support

from livefleet import FABRICS, LiveFleet  # noqa: E402
from recorded import GOLDEN, RECORDED, plugin_config, render, serve, documents  # noqa: E402


def record(tmp: Path) -> None:
    lf = LiveFleet(tmp / "live", {"a": 1, "b": 1}, replicas=2)
    f = lf.fleet
    f.config["models"].append({"name": "big", "source": "org/big"})
    f.config["profiles"].append({"name": "tp4", "engine": "vllm", "tensor_parallel_size": 4, "start_timeout": 60})
    f.config["deployments"].append({"model": "big", "profile": "tp4", "replicas": 1})
    f.write_config()
    lf.set_agent("b", fabrics=FABRICS, sysfs="port_init")
    f.start()
    try:
        f.wait_ready(2)
        RECORDED.mkdir(exist_ok=True)
        for old in RECORDED.glob("*.json"):
            old.unlink()
        for name, path in (("nodes", "/v1/nodes"), ("replicas", "/v1/replicas"), ("catalog", "/v1/catalog"),
                           ("explain-big", "/v1/explain/big")):
            (RECORDED / f"{name}.json").write_text(json.dumps(f.get(path), indent=1, sort_keys=True) + "\n")
    finally:
        f.close()


def goldens(tmp: Path) -> None:
    with serve(documents()) as url:
        out = render(tmp, url, plugin_config(tmp / "recorded.llmgw.yml", url))
    shutil.rmtree(GOLDEN, ignore_errors=True)
    GOLDEN.mkdir()
    for name, text in out.items():
        (GOLDEN / name).write_text(text)
    print(f"wrote {len(out)} goldens to {GOLDEN}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", action="store_true", help="record the API of a live fleet first")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        if args.record:
            record(Path(d))
        goldens(Path(d))


if __name__ == "__main__":
    main()
