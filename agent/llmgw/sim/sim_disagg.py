"""Prefill/decode disaggregation in the simulator, as vLLM's NixlConnector shows it to a router.

``--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":...}'`` makes the simulator one
side of a disaggregated pair. What a router sees is vLLM's (``toy_proxy_server.py`` drives it):

- **Prefill**: a request whose ``kv_transfer_params`` has ``do_remote_decode: true`` is
  prefilled, answered (``max_tokens`` 1, not streamed, as the router sends it), and its KV
  blocks are *held* for a remote decoder: the answer's ``kv_transfer_params`` say where
  (``remote_engine_id``, ``remote_block_ids``, ``remote_request_id``, ``remote_host``,
  ``remote_port``, ``tp_size``; the keys ``llmgw.kvtransfer`` requires). Held blocks are
  freed when a decoder pulls them or after ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` seconds (vLLM's
  variable, default 480): a decoder that comes later finds nothing.
- **Decode**: a request whose ``kv_transfer_params`` has ``do_remote_prefill: true`` pulls the
  blocks from the named engine's side channel before it runs; the prompt's prefill is replaced
  by the transfer (``LLMGW_SIM_KV_TRANSFER_TOKEN_LATENCY`` seconds per token). A pull that
  fails (unreachable side channel, another engine's id, blocks expired or already taken, a
  prompt of another length) fails the request with HTTP 500 under
  ``kv_load_failure_policy: "fail"`` (vLLM 0.32's default; ``"Internal server error"``, as vLLM
  says it; the reason goes to the log) and is prefilled locally under ``"recompute"``; either way
  the decoder stays healthy.

vLLM's NIXL metrics are served beside the others: ``vllm:nixl_xfer_time_seconds`` and
``vllm:nixl_num_failed_transfers`` on the decoder, ``vllm:nixl_num_kv_expired_reqs`` on the
prefill engine.

The side channel is the simulator's own stand-in for NIXL's (a ZMQ handshake, then RDMA or
UCX reads): plain HTTP on ``VLLM_NIXL_SIDE_CHANNEL_HOST``:``VLLM_NIXL_SIDE_CHANNEL_PORT`` (vLLM's
variables, defaults ``localhost`` and 5600), answering ``GET /nixl/<engine_id>/<request_id>``
once per held request. The fault ``kv-transfer-fail`` makes it refuse every pull (a broken
fabric). Output never depends on the transfer: the simulator's tokens are deterministic, so a
disaggregated answer equals an aggregated one, as it must with a real engine under greedy decoding.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import aiohttp
from aiohttp import web

from llmgw.sim.sim_args import KVTransferConfig

class TransferError(Exception):
    """Why a decode could not pull its prefilled blocks."""


def request_params(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The request's ``kv_transfer_params`` (vLLM: an object or absent)."""
    params = body.get("kv_transfer_params")
    return params if isinstance(params, dict) else None


@dataclass
class Held:
    """A prefilled request's blocks, kept for the decoder that will pull them."""

    allocs: list[Any]
    tokens: int
    expiry: asyncio.TimerHandle | None = None


class Transfers:
    """One engine's side of disaggregation: blocks held for decoders, pulls from prefill engines."""

    def __init__(self, cfg: KVTransferConfig, release: Callable[[list[Any]], None],
                 env: Mapping[str, str] = os.environ, token_latency: float = 0.0,
                 refuse: Callable[[], bool] = lambda: False, metrics: Any = None) -> None:
        self.cfg = cfg
        self.metrics = metrics  # sim_metrics.NixlMetrics, or None
        self.engine_id = cfg.engine_id or str(uuid.uuid4())
        self.host = env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost")
        self.port = int(env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))
        self.abort_timeout = float(env.get("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "480"))
        self.token_latency = token_latency
        self._release = release
        self._refuse = refuse
        self.held: dict[str, Held] = {}
        self._block_ids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    # ----------------------------------------------------------------- prefill side

    def hold(self, request_id: str, allocs: list[Any], tokens: int, cached: int = 0) -> dict[str, Any]:
        """Keep ``allocs`` for a decoder; the ``kv_transfer_params`` the answer carries, shaped as
        vLLM 0.32's (block ids one list per KV-cache group, the optional keys it fills in)."""
        blocks = sum(getattr(a, "blocks", 0) for a in allocs)
        held = Held(allocs, tokens)
        held.expiry = asyncio.get_running_loop().call_later(self.abort_timeout, self._expire, request_id)
        self.held[request_id] = held
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [[next(self._block_ids) for _ in range(blocks)]],
                "remote_engine_id": self.engine_id, "remote_request_id": request_id,
                "remote_host": self.host, "remote_port": self.port, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
                "remote_num_tokens": tokens, "remote_blocks_expiry_time": None, "transfer_mode": "pull",
                "remote_prefill_cached_tokens": cached}

    def _expire(self, request_id: str) -> None:
        held = self.held.pop(request_id, None)
        if held is not None:
            self._release(held.allocs)
            if self.metrics is not None:
                self.metrics.expired.inc()

    def _failed(self) -> None:
        if self.metrics is not None:
            self.metrics.failed.inc()

    async def _serve_pull(self, request: web.Request) -> web.Response:
        if self._refuse():
            return web.json_response({"error": "NIXL transfer failed"}, status=500)
        if request.match_info["engine"] != self.engine_id:
            return web.json_response({"error": f"remote engine id mismatch: this is {self.engine_id}"}, status=409)
        held = self.held.pop(request.match_info["request"], None)
        if held is None:
            return web.json_response({"error": "no blocks held for this request (expired or taken)"}, status=404)
        if held.expiry is not None:
            held.expiry.cancel()
        self._release(held.allocs)
        return web.json_response({"engine_id": self.engine_id, "tokens": held.tokens})

    async def start(self) -> None:
        """Listen on the side channel (prefill side) and open the client for pulls (decode side)."""
        if self.cfg.producer:
            app = web.Application()
            app.router.add_get("/nixl/{engine}/{request}", self._serve_pull)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            await web.TCPSite(self._runner, self.host, self.port).start()

    async def close(self) -> None:
        for held in self.held.values():
            if held.expiry is not None:
                held.expiry.cancel()
        self.held.clear()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # ----------------------------------------------------------------- decode side

    async def pull(self, params: Mapping[str, Any], prompt_tokens: int) -> int:
        """Pull a remote prefill's blocks; the prompt tokens they cover. Raises TransferError."""
        try:
            host, port = params["remote_host"], int(params["remote_port"])
            engine, rid = str(params["remote_engine_id"]), str(params["remote_request_id"])
        except (KeyError, TypeError, ValueError) as e:
            self._failed()
            raise TransferError(f"kv_transfer_params: {e!r}") from None
        started = asyncio.get_running_loop().time()
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        try:
            async with self._session.get(f"http://{host}:{port}/nixl/{engine}/{rid}") as resp:
                doc = await resp.json(content_type=None)
                if resp.status != 200:
                    raise TransferError(f"{engine}: {doc.get('error', resp.status)}")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            self._failed()
            raise TransferError(f"side channel {host}:{port}: {e!r}") from None
        except TransferError:
            self._failed()
            raise
        tokens = doc.get("tokens")
        if tokens != prompt_tokens:
            self._failed()
            raise TransferError(f"the prefill held {tokens} tokens, this prompt has {prompt_tokens}")
        if self.token_latency > 0:
            await asyncio.sleep(self.token_latency * tokens)
        if self.metrics is not None:
            self.metrics.xfer_time.observe(asyncio.get_running_loop().time() - started)
        return tokens
