"""An HTTP client for a control plane's admin API, as an operator's tools talk to it.

Mutual TLS against the fleet CA (``llmgw.tls.context.client_context``), with a
client certificate, a bearer token, or both; the same client for the test
fleet (``tests/integration/fleet.py``) and the scale benchmark's.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from llmgw.tls.context import client_context


def admin_client(url: str, ca: Path, cert: tuple[Path, Path] | None = None, token: str | None = None,
                 timeout: float = 30.0) -> httpx.Client:
    """A client for ``url`` trusting only ``ca``; ``cert`` is (certificate, key) for mutual TLS."""
    ctx = client_context(ca, *cert) if cert else client_context(ca)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=url, verify=ctx, headers=headers, timeout=timeout)
