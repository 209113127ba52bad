"""Print the serial of the certificate each TLS endpoint presents, as JSON.

The upgrade scenario compares these before and after a rotation through
site.yml: a new file on disk proves nothing until the process serving it has
restarted, so the serial is read from a live handshake, with the fleet CA and
the operator's certificate (the control plane asks every client for one).
"""

from __future__ import annotations

import argparse
import json
import socket
import ssl


def serial(ctx: ssl.SSLContext, address: str) -> str:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=host) as tls:
            return tls.getpeercert()["serialNumber"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--ca", required=True)
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("address", nargs="+", help="HOST:PORT")
    args = parser.parse_args()
    ctx = ssl.create_default_context(cafile=args.ca)
    ctx.load_cert_chain(args.cert, args.key)
    print(json.dumps({a: serial(ctx, a) for a in args.address}, sort_keys=True))


if __name__ == "__main__":
    main()
