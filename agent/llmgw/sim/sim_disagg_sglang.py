"""Prefill/decode disaggregation in the simulator's SGLang dialect, as SGLang 0.5.23 shows it to a router.

``--disaggregation-mode prefill|decode`` makes an ``sglang`` simulator one side of a pair. A router
drives the pair as SGLang's own does: one request to each side *at once*, both carrying
``bootstrap_host`` (the prefill's address), ``bootstrap_port`` (its ``--disaggregation-bootstrap-port``)
and ``bootstrap_room`` (an integer naming the pair); the client gets the decoder's answer.

- **Prefill**: the request waits in the bootstrap queue (``sglang:num_prefill_bootstrap_queue_reqs``)
  until a decoder claims its room, at most ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` seconds
  (SGLang's variable, default 300; then HTTP 500 and ``sglang:num_bootstrap_failed_reqs_total``).
  It is then prefilled as usual, sends the prompt's KV (``LLMGW_SIM_KV_TRANSFER_TOKEN_LATENCY``
  seconds per token, observed in ``sglang:kv_transfer_latency_ms``) and answers its one token, as
  SGLang's prefill server does. Without ``bootstrap_room`` it is refused with 400.
- **Decode**: the request claims its room at the prefill's bootstrap server and waits for the KV
  (``sglang:num_decode_transfer_queue_reqs``), at most ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``
  seconds (default 300), then decodes exactly as an aggregated engine would, the prompt's prefill
  replaced by the transfer. A decode server cannot prefill: a request without bootstrap fields, or
  whose transfer fails (bootstrap unreachable, room spent or claimed twice, no prefill in time, a
  prompt of another length, a broken fabric), answers HTTP 500 before any output and counts in
  ``sglang:num_transfer_failed_reqs_total`` (``sglang:num_bootstrap_failed_reqs_total`` when there was
  no handshake); the server stays healthy.
- ``bootstrap_host`` 2.2.2.2 (SGLang's ``FAKE_BOOTSTRAP_HOST``, what its ``/health_generate`` sends) is
  a fake transfer on either side: no peer, answered at once.

Either side may arrive first. A room is one-shot: it closes when its KV has been sent, its transfer
failed, or the side waiting gave up (timeout, or its client went away), and its id is refused after.

The bootstrap server is the simulator's own stand-in for SGLang's (an aiohttp registry of prefill ranks
on ``--host``:``--disaggregation-bootstrap-port``) and for the KV transfer behind it (Mooncake or NIXL
writes into the decoder's pages, keyed by room): plain HTTP on the same address, ``GET /health``
(``OK``, as SGLang's answers) and ``POST /rooms/<room>``, a decoder's claim, answered once the KV
was sent. The fault ``kv-transfer-fail`` on either side fails the transfer on both (a broken fabric).
Output never depends on the transfer: the simulator's tokens are deterministic, so a disaggregated
answer equals an aggregated one, as it must with a real engine under greedy decoding.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import aiohttp
from aiohttp import web

from llmgw import kvbootstrap
from llmgw.sim.sim_args import DisaggregationConfig

FAKE_BOOTSTRAP_HOST = kvbootstrap.FAKE_HOST  # sglang.srt.disaggregation.utils
DEFAULT_TIMEOUT = 300  # SGLang's SGLANG_DISAGGREGATION_{BOOTSTRAP,WAITING}_TIMEOUT
SPENT_ROOMS = 100_000  # room ids remembered as used, so a late or repeated one is refused
CLIENT_GRACE = 5.0  # the decoder's HTTP wait beyond the claim's own timeout, which the server enforces


# ------------------------------------------------------------------------------ request fields

def error_body(code: int, message: str, kind: str | None = None) -> dict[str, Any]:
    """SGLang's ErrorResponse: a refused request's type is ``BadRequest``, an aborted one's its status."""
    return {"object": "error", "message": message, "type": kind or str(code), "param": None, "code": code}


class DisaggError(Exception):
    """A request the exchange refused or failed; ``response`` is SGLang's answer for it."""

    def __init__(self, code: int, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.response = web.json_response(error_body(code, message, kind), status=code)


@dataclass(frozen=True)
class Bootstrap:
    """A request's bootstrap fields (SGLang's PDRoutingFields)."""

    host: str | None = None
    port: int | None = None
    room: int | None = None

    @property
    def fake(self) -> bool:
        return self.host == FAKE_BOOTSTRAP_HOST

    def missing(self) -> list[str]:
        return [name for name, v in (("bootstrap_host", self.host), ("bootstrap_port", self.port),
                                     ("bootstrap_room", self.room)) if v is None]


def bootstrap_of(body: Mapping[str, Any]) -> Bootstrap:
    """The bootstrap fields of a request body, scalar forms only (the simulator serves one prompt per pair)."""
    host, port, room = (body.get(k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room"))
    if any(isinstance(v, list) for v in (host, port, room)):
        raise DisaggError(400, "bootstrap_host, bootstrap_port and bootstrap_room: the simulator takes "
                               "one value each, not a list", "BadRequest")
    if host is not None and not isinstance(host, str):
        raise DisaggError(400, f"bootstrap_host must be a string, got {host!r}", "BadRequest")
    for name, v in (("bootstrap_port", port), ("bootstrap_room", room)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise DisaggError(400, f"{name} must be a non-negative integer, got {v!r}", "BadRequest")
    return Bootstrap(host, port, room)


@dataclass(frozen=True)
class Timeouts:
    bootstrap: float = DEFAULT_TIMEOUT  # prefill: how long a room waits for its decoder
    waiting: float = DEFAULT_TIMEOUT  # decode: how long a claim waits for its KV


def env_int(env: Mapping[str, str], name: str, default: int) -> int:
    """As SGLang's EnvInt reads a variable: an integer, else the default with a warning."""
    value = env.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        log("WARNING", "environ.py", f'Invalid value for {name}: "{value}" is not a valid integer value, '
                                     f'using default "{default}"')
        return default


def timeouts_from_env(env: Mapping[str, str]) -> Timeouts:
    return Timeouts(env_int(env, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", DEFAULT_TIMEOUT),
                    env_int(env, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", DEFAULT_TIMEOUT))


def host_ip(env: Mapping[str, str]) -> str | None:
    """The address SGLang's KV manager advertises (``SGLANG_HOST_IP``, else ``HOST_IP``); None: it guesses."""
    return env.get("SGLANG_HOST_IP") or env.get("HOST_IP") or None


def log(level: str, where: str, message: str) -> None:
    sys.stderr.write(f"{level} {time.strftime('%m-%d %H:%M:%S')} [{where}] {message}\n")
    sys.stderr.flush()


# ------------------------------------------------------------------------------ rooms

@dataclass(frozen=True)
class Claim:
    """What a decoder tells the prefill when it claims a room."""

    tokens: int  # its prompt's length: the pages it made room for
    fabric_ok: bool = True  # False: its end of the fabric is broken (kv-transfer-fail)


@dataclass(frozen=True)
class Outcome:
    """How a room's transfer ended, for the decoder waiting on it."""

    tokens: int = 0
    error: str | None = None


class RoomRefused(Exception):
    """A room id that cannot be used: spent, already claimed, or already held by a prefill."""


class Room:
    """One pair's meeting point: the decoder's claim and the transfer's outcome."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.claimed: asyncio.Future[Claim] = loop.create_future()
        self.outcome: asyncio.Future[Outcome] = loop.create_future()
        self.prefilling = False  # a prefill request holds it
        self.abandoned = False  # its decoder stopped waiting after it claimed


class Rooms:
    """The prefill server's rooms, shared by its generation requests and its bootstrap server.

    A room opens when either side arrives and closes, its id spent for good, when its KV has been sent,
    its transfer failed, or the side waiting alone gave up. ``on_change`` gets the rooms waiting for a
    decoder (SGLang's bootstrap queue) after each change.
    """

    def __init__(self, on_change: Callable[[int], None] = lambda waiting: None, remember: int = SPENT_ROOMS) -> None:
        self.open: dict[int, Room] = {}
        self._spent: OrderedDict[int, None] = OrderedDict()
        self._remember = remember
        self._on_change = on_change

    def waiting_for_decoder(self) -> int:
        return sum(1 for r in self.open.values() if r.prefilling and not r.claimed.done())

    def _changed(self) -> None:
        self._on_change(self.waiting_for_decoder())

    def _room(self, room_id: int) -> Room:
        if room_id in self._spent:
            raise RoomRefused(f"room {room_id} was already used: a bootstrap room is one-shot")
        room = self.open.get(room_id)
        if room is None:
            room = self.open[room_id] = Room()
        return room

    def close(self, room_id: int, room: Room, outcome: Outcome) -> None:
        """End a room: tell its decoder how, if one waits, and spend its id."""
        if not room.outcome.done():
            room.outcome.set_result(outcome)
        if self.open.get(room_id) is room:
            del self.open[room_id]
            self._spent[room_id] = None
            while len(self._spent) > self._remember:
                self._spent.popitem(last=False)
        self._changed()

    async def await_claim(self, room_id: int, timeout: float) -> tuple[Room, Claim]:
        """Prefill side: hold the room until a decoder claims it; TimeoutError after ``timeout`` seconds."""
        room = self._room(room_id)
        if room.prefilling:
            raise RoomRefused(f"room {room_id} is held by another prefill request")
        room.prefilling = True
        self._changed()
        try:
            done, _ = await asyncio.wait({room.claimed}, timeout=timeout)
        except BaseException:
            self.close(room_id, room, Outcome(error="the prefill request was aborted"))
            raise
        if not done:
            why = f"Request {room_id} timed out after {timeout:.1f}s in KVPoll.Bootstrapping"
            self.close(room_id, room, Outcome(error=why))
            raise TimeoutError(why)
        return room, room.claimed.result()

    async def claim(self, room_id: int, claim: Claim, timeout: float) -> Outcome:
        """Decoder side (through the bootstrap server): claim the room, then wait for its transfer's end."""
        room = self._room(room_id)
        if room.claimed.done():
            raise RoomRefused(f"room {room_id} was already claimed by another decoder")
        room.claimed.set_result(claim)
        self._changed()
        try:
            done, _ = await asyncio.wait({room.outcome}, timeout=timeout)
        except BaseException:
            self._give_up(room_id, room, "the decoder went away")
            raise
        if not done:
            why = f"Request {room_id} timed out after {timeout:.1f}s in KVPoll.WaitingForInput"
            self._give_up(room_id, room, why)
            return Outcome(error=why)
        return room.outcome.result()

    def _give_up(self, room_id: int, room: Room, why: str) -> None:
        """The decoder stops waiting: a room no prefill holds closes now; a held one fails when it sends."""
        if room.prefilling:
            room.abandoned = True
        else:
            self.close(room_id, room, Outcome(error=why))


# ------------------------------------------------------------------------------ bootstrap server

class BootstrapServer:
    """The prefill's bootstrap server stand-in: decoders claim rooms here and wait for their KV."""

    def __init__(self, rooms: Rooms, host: str | None, port: int) -> None:
        self.rooms = rooms
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/rooms/{room}", self._claim)
        # a decoder that goes away takes its claim with it
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _claim(self, request: web.Request) -> web.Response:
        try:
            room_id = int(request.match_info["room"])
            doc = await request.json()
            claim = Claim(int(doc["prompt_tokens"]), bool(doc.get("fabric_ok", True)))
            timeout = float(doc.get("timeout", DEFAULT_TIMEOUT))
        except (KeyError, TypeError, ValueError) as e:
            return web.json_response({"error": f"bad claim: {e!r}"}, status=400)
        if room_id < 0 or claim.tokens < 0 or timeout <= 0:
            return web.json_response({"error": "bad claim: room, prompt_tokens and timeout must be positive"},
                                     status=400)
        try:
            outcome = await self.rooms.claim(room_id, claim, timeout)
        except RoomRefused as e:
            return web.json_response({"error": str(e)}, status=409)
        if outcome.error is not None:
            return web.json_response({"error": outcome.error}, status=500)
        return web.json_response({"room": room_id, "tokens": outcome.tokens})


class BootstrapUnreachable(Exception):
    """No handshake: the bootstrap server named by the request could not be reached."""


class BootstrapClient:
    """The decoder's side of the claim: one HTTP request, answered when the KV has arrived."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def claim(self, b: Bootstrap, claim: Claim, timeout: float) -> Outcome:
        """The transfer's outcome; raises BootstrapUnreachable when there was no one to ask."""
        host = f"[{b.host}]" if b.host and ":" in b.host else b.host
        where = f"{host}:{b.port}"
        if self._session is None:
            self._session = aiohttp.ClientSession()
        body = {"prompt_tokens": claim.tokens, "fabric_ok": claim.fabric_ok, "timeout": timeout}
        try:
            async with self._session.post(f"http://{where}/rooms/{b.room}", json=body,
                                          timeout=aiohttp.ClientTimeout(total=timeout + CLIENT_GRACE)) as resp:
                doc = await resp.json(content_type=None)
        except (aiohttp.ClientConnectorError, aiohttp.InvalidURL) as e:
            raise BootstrapUnreachable(f"bootstrap server {where}: {e}") from None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            return Outcome(error=f"bootstrap server {where}: {e!r}")
        if not isinstance(doc, dict):
            return Outcome(error=f"bootstrap server {where}: answered {resp.status} without a JSON object")
        if resp.status != 200:
            return Outcome(error=str(doc.get("error", f"HTTP {resp.status}")))
        return Outcome(tokens=int(doc.get("tokens", -1)))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


# ------------------------------------------------------------------------------ one request's exchange

class Exchange:
    """What a request does beyond an aggregated engine's work; this one nothing (a fake transfer, a
    decoder's KV already in). ``transferred``: prompt tokens whose prefill the transfer replaced."""

    def __init__(self, transferred: int = 0) -> None:
        self.transferred = transferred

    async def after_prefill(self) -> web.Response | None:
        """Run once the request is prefilled; an error answer when its transfer failed."""
        return None

    async def __aenter__(self) -> "Exchange":
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


class Sending(Exchange):
    """A prefill request whose room a decoder claimed: after its prefill it sends the KV."""

    def __init__(self, side: "SGLangDisagg", room_id: int, room: Room, claim: Claim, tokens: int, rid: str) -> None:
        super().__init__()
        self.side, self.room_id, self.room, self.claim, self.tokens, self.rid = side, room_id, room, claim, tokens, rid

    async def after_prefill(self) -> web.Response | None:
        side, m = self.side, self.side.metrics
        problem = side.send_problem(self.claim, self.tokens)
        clock = asyncio.get_running_loop().time
        started = clock()
        if problem is None:
            m.inflight_queue.inc()
            try:
                await asyncio.sleep(side.token_latency * self.tokens)
            finally:
                m.inflight_queue.dec()
            if self.room.abandoned:
                problem = "the decoder stopped waiting for the KV"
        if problem is not None:
            side.rooms.close(self.room_id, self.room, Outcome(error=problem))
            m.transfer_failed.inc()
            message = (f"Prefill transfer failed for request rank=0 req.rid='{self.rid}' "
                       f"req.bootstrap_room={self.room_id} with exception {problem}")
            log("WARNING", "prefill.py:1299", message)
            return DisaggError(500, message).response
        side.rooms.close(self.room_id, self.room, Outcome(tokens=self.tokens))
        m.transfer_latency_ms.observe((clock() - started) * 1000)
        return None

    async def __aexit__(self, *exc: object) -> None:
        """A request that ends before sending (aborted, cancelled) fails its room at once."""
        if not self.room.outcome.done():
            self.side.rooms.close(self.room_id, self.room, Outcome(error="the prefill request was aborted"))


# ------------------------------------------------------------------------------ one server's side

class SGLangDisagg:
    """One SGLang server's side of disaggregation, for the simulator's generation handlers."""

    def __init__(self, cfg: DisaggregationConfig, host: str | None, metrics: Any, token_latency: float = 0.0,
                 refuse: Callable[[], bool] = lambda: False, env: Mapping[str, str] = os.environ) -> None:
        self.cfg = cfg
        self.metrics = metrics  # sim_metrics.SGLangDisaggMetrics
        self.token_latency = token_latency
        self._refuse = refuse
        self.timeouts = timeouts_from_env(env)
        self.host_ip = host_ip(env)
        self.rooms = Rooms(on_change=metrics.bootstrap_queue.set)
        self.server = BootstrapServer(self.rooms, host, cfg.bootstrap_port) if cfg.prefill else None
        self.client = None if cfg.prefill else BootstrapClient()

    @property
    def prefill(self) -> bool:
        return self.cfg.prefill

    async def start(self) -> None:
        if self.server is not None:
            await self.server.start()

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()
        if self.client is not None:
            await self.client.close()

    def request_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The request as this server runs it: a prefill server generates its one token and stops."""
        if not self.prefill:
            return body
        return {**{k: v for k, v in body.items() if k != "max_completion_tokens"}, "max_tokens": 1}

    def send_problem(self, claim: Claim, tokens: int) -> str | None:
        """Why the KV cannot go to the decoder that claimed it; None: it can."""
        if self._refuse():
            return "KV transfer failed: the fabric is down (kv-transfer-fail)"
        if not claim.fabric_ok:
            return "KV transfer failed: the decoder's end of the fabric is down"
        if claim.tokens != tokens:
            return f"the decoder made room for {claim.tokens} prompt tokens, this prefill has {tokens}"
        return None

    async def begin(self, body: Mapping[str, Any], prompt_lens: list[int], choices: int) -> Exchange:
        """Check the request's bootstrap fields and meet its peer: a prefill returns once a decoder claimed
        its room, a decode once its KV arrived. Raises DisaggError with the answer to give instead."""
        b = bootstrap_of(body)
        fake = b.fake or (not self.prefill and b.host is None and self.cfg.transfer_backend == "fake")
        if not fake and (len(prompt_lens) != 1 or choices != 1):
            raise DisaggError(400, "a disaggregated request carries one prompt and n=1 in the simulator",
                              "BadRequest")
        if self.prefill:
            return Exchange() if fake else await self._meet_decoder(b, prompt_lens[0])
        return Exchange(sum(prompt_lens)) if fake else await self._receive(b, prompt_lens[0])

    async def _meet_decoder(self, b: Bootstrap, tokens: int) -> Exchange:
        if b.room is None:
            raise DisaggError(400, "bootstrap_room is required by a prefill server (--disaggregation-mode "
                                   "prefill): the decoder claims the KV by it", "BadRequest")
        rid = uuid.uuid4().hex
        try:
            room, claim = await self.rooms.await_claim(b.room, self.timeouts.bootstrap)
        except (RoomRefused, TimeoutError) as e:
            self.metrics.bootstrap_failed.inc()
            message = (f"Prefill bootstrap failed for request rank=0 req.rid='{rid}' req.bootstrap_room={b.room} "
                       f"with exception {e}")
            log("WARNING", "prefill.py:1357", message)
            raise DisaggError(500, message) from None
        return Sending(self, b.room, room, claim, tokens, rid)

    async def _receive(self, b: Bootstrap, tokens: int) -> Exchange:
        rid = uuid.uuid4().hex
        missing = b.missing()
        if missing:
            self.metrics.bootstrap_failed.inc()
            raise self._failed("handshake", rid, b.room, f"{', '.join(missing)} missing: a decode server "
                               "(--disaggregation-mode decode) cannot prefill; it needs a prefill server's KV")
        assert self.client is not None
        self.metrics.transfer_queue.inc()
        try:
            outcome = await self.client.claim(b, Claim(tokens, fabric_ok=not self._refuse()), self.timeouts.waiting)
        except BootstrapUnreachable as e:
            self.metrics.bootstrap_failed.inc()
            raise self._failed("handshake", rid, b.room, str(e)) from None
        finally:
            self.metrics.transfer_queue.dec()
        error = outcome.error
        if error is None and outcome.tokens != tokens:
            error = f"the prefill sent {outcome.tokens} prompt tokens, this prompt has {tokens}"
        if error is not None:
            self.metrics.transfer_failed.inc()
            raise self._failed("transfer", rid, b.room, error)
        return Exchange(tokens)

    def _failed(self, stage: str, rid: str, room: int | None, why: str) -> DisaggError:
        message = (f"Decode {stage} failed for request rank=0 decode_req.req.rid='{rid}' "
                   f"decode_req.req.bootstrap_room={room} with exception {why}")
        log("ERROR", "decode.py:2870" if stage == "transfer" else "decode.py:1170", message)
        return DisaggError(500, message)
