"""Rank-0 readiness: a real one-token completion, not only ``/health``.

vLLM answers ``/health`` with 200 as soon as its HTTP server is up, which
can be long before (or entirely without) the model being able to generate:
a wedged worker, an NCCL hang on the first all-reduce, a sampler that fails
on the first request.  The only evidence that a replica can serve is that it
served, so rank 0 is Ready only after ``POST /v1/completions`` with
``max_tokens: 1`` returns a choice.  Ranks > 0 serve no HTTP and are judged
by liveness (their process is running).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import ssl
from dataclasses import dataclass
from typing import Any, Mapping

import aiohttp


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str  # what went wrong (or "ok"), for logs and the failure reason


def probe_host(bind_host: str) -> str:
    """Where to reach an engine bound to ``bind_host`` from this node."""
    if bind_host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if bind_host in ("::", "[::]"):
        return "::1"
    return bind_host


def is_loopback(bind_host: str) -> bool:
    """Whether an engine bound to ``bind_host`` is reachable from this node only."""
    if bind_host == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind_host.strip("[]")).is_loopback
    except ValueError:
        return False


def base_url(host: str, port: int, scheme: str = "http") -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


@dataclass(frozen=True)
class EngineTLSClient:
    """How the agent verifies an engine serving TLS: the fleet CA, and the name its certificate holds.

    The name is the node's fleet address (the engine certificate's SAN), also when
    the probe dials 127.0.0.1 because engines bind every interface.
    """

    context: ssl.SSLContext
    server_hostname: str

    def request_kwargs(self) -> dict[str, Any]:
        return {"ssl": self.context, "server_hostname": self.server_hostname}


def _tls_kwargs(tls: EngineTLSClient | None) -> dict[str, Any]:
    return tls.request_kwargs() if tls is not None else {}


async def completion_probe(session: aiohttp.ClientSession, url: str, served_name: str,
                           timeout: float, api_key: str | None = None,
                           tls: EngineTLSClient | None = None, extra: Mapping[str, Any] | None = None) -> ProbeResult:
    """One attempt: does the engine at ``url`` complete one token for ``served_name``?

    With the replica's engine key, as the router sends it: a probe that got
    in without it would prove nothing about the path traffic takes.  ``extra``:
    the adapter's fields for an engine that needs them (``Adapter.probe_fields``).
    """
    body = {"model": served_name, "prompt": "ping", "max_tokens": 1, **(extra or {})}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout), **_tls_kwargs(tls)) as resp:
            text = await resp.text(errors="replace")
            if resp.status != 200:
                return ProbeResult(False, f"completion probe: HTTP {resp.status}: {text[:300]}")
            try:
                doc = json.loads(text)
            except ValueError:
                return ProbeResult(False, f"completion probe: response is not JSON: {text[:300]}")
            choices = doc.get("choices") if isinstance(doc, dict) else None
            if not isinstance(choices, list) or not choices:
                return ProbeResult(False, f"completion probe: no choice in response: {text[:300]}")
            return ProbeResult(True, "ok")
    except asyncio.TimeoutError:
        return ProbeResult(False, f"completion probe: no answer within {timeout:g}s")
    except aiohttp.ClientError as e:
        return ProbeResult(False, f"completion probe: {type(e).__name__}: {e}")


async def get_text(session: aiohttp.ClientSession, url: str, timeout: float,
                   what: str, api_key: str | None = None,
                   tls: EngineTLSClient | None = None) -> tuple[int | None, str]:
    """(status, body) of a GET; (None, what went wrong) when no answer came within ``timeout``.

    With ``api_key`` the engine key goes along: llama-server keeps ``/metrics`` behind it.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout),
                               **_tls_kwargs(tls)) as resp:
            return resp.status, await resp.text(errors="replace")
    except asyncio.TimeoutError:
        return None, f"{what}: no answer within {timeout:g}s"
    except aiohttp.ClientError as e:
        return None, f"{what}: {type(e).__name__}: {e}"


# Where each engine says which release it is, and the field that holds it: vLLM's ``/version``,
# SGLang's ``/server_info`` (``/get_server_info`` before 0.5.2x, now deprecated with a log line per
# call), llama-server's ``/props`` (its ``build_info``, e.g. ``b7100-1a2b3c4``).
VERSION_ENDPOINTS: dict[str, tuple[str, str]] = {
    "vllm": ("/version", "version"),
    "sglang": ("/server_info", "version"),
    "llamacpp": ("/props", "build_info"),
}
MAX_VERSION = 256


def version_from(engine: str, body: str) -> str | None:
    """The version in an engine's answer on its version endpoint; None when it holds none."""
    if engine not in VERSION_ENDPOINTS:
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    value = doc.get(VERSION_ENDPOINTS[engine][1]) if isinstance(doc, dict) else None
    if not isinstance(value, str):
        return None
    value = value.strip()[:MAX_VERSION]
    return value if value and value.isprintable() else None


async def engine_version(session: aiohttp.ClientSession, url: str, engine: str, timeout: float,
                         api_key: str | None = None, tls: EngineTLSClient | None = None) -> str | None:
    """The engine's own word on its release, read once after Ready; None when it gives none.

    Informational only: an engine that does not answer is no less Ready.
    """
    if engine not in VERSION_ENDPOINTS:
        return None
    status, body = await get_text(session, url + VERSION_ENDPOINTS[engine][0], timeout, "version", api_key, tls)
    return version_from(engine, body) if status == 200 else None
