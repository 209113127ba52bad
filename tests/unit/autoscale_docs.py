"""A server.yaml with one autoscaled deployment, and the errors a document gets, by pointer."""

from __future__ import annotations

import pytest

from llmgw.config import ConfigInvalid
from llmgw.settings import parse_server_settings

SERVER = {
    "api": {"listen": {"port": 8443}},
    "insecure_no_tls": True,
    "router": {"listen": {"port": 8080}, "insecure_http": True, "allow_unauthenticated": True},
    "models": [{"name": "m", "source": "Qwen/Qwen2.5-0.5B-Instruct"}],
    "profiles": [{"name": "p", "engine": "vllm"}],
    "deployments": [{"model": "m", "profile": "p", "replicas": 1, "autoscale": {"max": 4}}],
}


def errors(doc) -> dict[str, str]:
    with pytest.raises(ConfigInvalid) as e:
        parse_server_settings(doc)
    return {x.pointer: x.message for x in e.value.errors}
