"""Wait until exactly one of the given control planes leads and every other stands by.

Every control plane is asked in one pass, again and again: a pass must find
exactly one leader and every control plane answering. Prints the roles by URL
(JSON) and exits 0; exits non-zero naming the last pass's roles after the
deadline.

    one_leader.py --ca CA --cert CERT --key KEY [--deadline S] URL...
"""

from __future__ import annotations

import argparse
import json
import ssl
import sys
import time

import httpx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ca", required=True)
    ap.add_argument("--cert", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds to wait")
    ap.add_argument("urls", nargs="+", help="each control plane's API, https://HOST:PORT")
    args = ap.parse_args()
    ctx = ssl.create_default_context(cafile=args.ca)
    ctx.load_cert_chain(args.cert, args.key)
    deadline, roles = time.monotonic() + args.deadline, {}
    while time.monotonic() < deadline:
        roles = {}
        for url in args.urls:
            try:
                roles[url] = httpx.get(url + "/v1/replicas", verify=ctx, timeout=5).headers.get("x-llmgw-role", "leader")
            except httpx.HTTPError as e:
                roles[url] = f"no answer: {e}"
        if list(roles.values()).count("leader") == 1 and all(r in ("leader", "standby") for r in roles.values()):
            print(json.dumps(roles))
            return 0
        time.sleep(0.5)
    print("no single leader: " + json.dumps(roles), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
