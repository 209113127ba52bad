"""vLLM's sleep mode in the simulator: ``POST /sleep?level=1|2``, ``POST /wake_up``, ``GET /is_sleeping``.

Scale-to-sleep (issue #32) puts an idle replica to sleep and wakes it when
a request for its model arrives, so the fleet simulator must sleep and wake
the way vLLM does, with times that tests and benchmarks set:

- The routes exist only with ``VLLM_SERVER_DEV_MODE=1``, as vLLM attaches them.
- ``POST /sleep?level=1`` (the default) keeps the weights in host memory;
  ``level=2`` drops them.  It takes ``LLMGW_SIM_SLEEP_TIME`` and answers 200
  with no body once asleep, as vLLM's route does; sleeping again is a no-op.
- ``POST /wake_up`` takes ``LLMGW_SIM_WAKE_TIME`` after a level-1 sleep and
  ``LLMGW_SIM_WAKE_TIME_LEVEL2`` after a level-2 one (the weights are read
  again), then answers 200.  ``?tags=weights`` / ``?tags=kv_cache`` wake one
  part (vLLM's fine-grained wake); the engine is awake once both are.
- ``GET /is_sleeping``: ``{"is_sleeping": bool}``, true from the end of a
  sleep until the end of the wake that completes it.
- From the moment a sleep begins until the engine is awake again, every
  completion or embedding request is answered 503 in vLLM's error shape
  (the model's memory is not there to serve it); requests already running
  when the sleep began finish.  ``/health``, ``/metrics`` and ``/v1/models``
  answer as usual, so a sleeping replica is not judged dead.

Simulator stances, to hold against the real engine: without
``--enable-sleep-mode`` ``/sleep`` is refused (400) rather than accepted
and freeing nothing; a level other than 1 or 2, or an unknown tag, is a 400
(vLLM answers 500 for a level that is not a number).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

SLEEP_PATHS = ("/sleep", "/wake_up", "/is_sleeping")
TAGS = ("weights", "kv_cache")
REFUSED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


class SleepState:
    """One engine's sleep: its level, the parts still asleep, and one transition at a time."""

    def __init__(self, enabled: bool, sleep_time: float, wake_time: float, wake_time_level2: float):
        self.enabled = enabled
        self.sleep_time, self.wake_time, self.wake_time_level2 = sleep_time, wake_time, wake_time_level2
        self.level = 0  # 0: awake; 1 or 2: the level of the last sleep, until fully awake
        self.asleep: set[str] = set()  # the parts (TAGS) still asleep
        self.transition: str | None = None  # "sleeping" | "waking" while a call is under way
        self.sleeps = 0
        self.wakes = 0
        self._lock = asyncio.Lock()

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    @property
    def serving(self) -> bool:
        """Whether a new request may run: awake and not on the way to sleep or back."""
        return not self.asleep and self.transition is None

    async def sleep(self, level: int) -> None:
        async with self._lock:
            if self.asleep:
                return  # vLLM: "Executor is already sleeping."
            self.transition = "sleeping"
            try:
                await asyncio.sleep(self.sleep_time)
                self.level, self.asleep = level, set(TAGS)
                self.sleeps += 1
            finally:
                self.transition = None

    async def wake(self, tags: tuple[str, ...] | None) -> None:
        async with self._lock:
            parts = set(tags or TAGS) & self.asleep
            if not parts:
                return
            self.transition = "waking"
            try:
                if "weights" in parts:
                    await asyncio.sleep(self.wake_time if self.level == 1 else self.wake_time_level2)
                self.asleep -= parts
                if not self.asleep:
                    self.level = 0
                    self.wakes += 1
            finally:
                self.transition = None


def _bad(message: str, param: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "BadRequestError", "param": param,
                                        "code": 400}}, status=400)


def handlers(state: SleepState):
    async def sleep(request: web.Request) -> web.Response:
        if not state.enabled:
            return _bad("sleep mode is not enabled: start the engine with --enable-sleep-mode", "level")
        raw = request.query.get("level", "1")
        if raw not in ("1", "2"):
            return _bad(f"level must be 1 or 2, not {raw!r}", "level")
        await state.sleep(int(raw))
        return web.Response(status=200)

    async def wake_up(request: web.Request) -> web.Response:
        tags = tuple(request.query.getall("tags", ()))
        unknown = [t for t in tags if t not in TAGS]
        if unknown:
            return _bad(f"unknown tags {unknown}; known: {', '.join(TAGS)}", "tags")
        await state.wake(tags or None)
        return web.Response(status=200)

    async def is_sleeping(request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": state.is_sleeping})

    return sleep, wake_up, is_sleeping


def add_routes(app: web.Application, state: SleepState) -> None:
    sleep, wake_up, is_sleeping = handlers(state)
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_get("/is_sleeping", is_sleeping)


def sleep_middleware(state: SleepState, refuse):
    """New requests that need the model's memory answered ``refuse(message)`` (a 503) while it sleeps."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        if request.path in REFUSED_PATHS and not state.serving:
            what = "waking up" if state.transition == "waking" else "sleeping"
            return refuse(f"The model is {what} (sleep level {state.level or '-'}); POST /wake_up first")
        return await handler(request)

    return middleware
