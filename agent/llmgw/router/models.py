"""The answers about what the router serves: ``/v1/models``, unknown models and paths without a route.

What a key may not use is answered exactly as what does not exist, so a
restricted key never learns which models the fleet serves.
"""

from __future__ import annotations

import time
from typing import Callable

from aiohttp import web

from .auth import KeyRing
from .context import RequestContext
from .errors import INVALID_REQUEST, RouterError
from .failures import model_not_found, model_not_ready
from .metrics import RouterMetrics
from .request import authenticate
from .runtime import Routing

OPENAI_POST_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


class Models:
    def __init__(self, routing: Routing, keys: KeyRing, metrics: RouterMetrics,
                 pending: Callable[[str], float] | None = None) -> None:
        self.routing = routing
        self.keys = keys
        self.metrics = metrics
        # seconds until the table can be trusted to list ``model`` (0: it can now); see build_app
        self.pending = pending
        self.started = int(time.time())

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.started, "owned_by": "llmgw"}

    async def list_models(self, request: web.Request, ctx: RequestContext) -> web.Response:
        principal = authenticate(self.keys, request)
        ctx.key = principal.name
        self.routing.sync()
        data = [self._model_card(m) for m in self.routing.models() if principal.allows(m)]
        return web.json_response({"object": "list", "data": data})

    async def get_model(self, request: web.Request, ctx: RequestContext) -> web.Response:
        principal = authenticate(self.keys, request)
        ctx.key = principal.name
        self.routing.sync()
        name = request.match_info["model"]
        ctx.model = name
        if name in self.routing.models() and principal.allows(name):
            return web.json_response(self._model_card(name))
        raise self.unknown_model(name, principal.allows(name))

    def unknown_model(self, model: str, allowed: bool) -> RouterError:
        """404 for a model the table lacks, unless the table is still filling up.

        A control plane that has just started learns its replicas from agents
        re-registering; until then "this model does not exist" would be a lie
        that OpenAI clients do not retry, so such a model is "not available
        yet": 503 with Retry-After.  A key that may not use the model always
        gets the 404, so the answer never depends on what exists.
        """
        left = self.pending(model) if allowed and self.pending is not None else 0.0
        if left > 0:
            return model_not_ready(model, left)
        return model_not_found(model)

    async def fallback(self, request: web.Request, ctx: RequestContext) -> web.Response:
        """Every path and method the app has no route for: 405 on known paths, else 404."""
        if request.path in OPENAI_POST_PATHS or request.path.startswith("/v1/models"):
            allow = "POST" if request.path in OPENAI_POST_PATHS else "GET"
            err = RouterError(405, f"method {request.method} not allowed on {request.path}; use {allow}",
                              INVALID_REQUEST, "method_not_allowed", klass="method_not_allowed")
            self.metrics.error("-", err.klass)
            resp = err.response()
            resp.headers["Allow"] = allow
            return resp
        raise RouterError(404, f"unknown path {request.path}", INVALID_REQUEST, "unknown_url", klass="unknown_url")
