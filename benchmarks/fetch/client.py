"""One llmgw fetch, as its own process, the way curl runs as its own process.

Prints one JSON line: bytes, seconds inside ``fetch_weights`` (first request
to the renamed, directory-fsync'd file) and the resulting path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from llmgw.agent.fetch import fetch_weights
from llmgw.catalog import Model
from llmgw.settings import FetchPolicy


async def main(url: str, out: str, sha256: str | None) -> None:
    model = Model(name="bench", source=url, served_name="bench", sha256=sha256)
    t0 = time.perf_counter()
    path = await fetch_weights(model, out, progress=lambda m: None, shard_id="bench/r0", node_id="bench",
                               policy=FetchPolicy())
    took = time.perf_counter() - t0
    print(json.dumps({"bytes": os.path.getsize(path), "seconds": took, "path": path}), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("out")
    ap.add_argument("--sha256")
    a = ap.parse_args()
    asyncio.run(main(a.url, a.out, a.sha256))
