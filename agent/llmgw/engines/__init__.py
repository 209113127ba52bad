"""Engine adapters: vLLM, SGLang, llama.cpp.

Pure functions of (model, profile, launch context) -> LaunchSpec.  The agent
validates a profile before it launches anything, because an engine that
refuses its arguments does so only after minutes of loading weights.
"""

from __future__ import annotations

from llmgw.catalog import Model, Profile
from llmgw.engines.base import (
    LaunchContext,
    LaunchContextError,
    LaunchSpec,
    ProfileError,
    SourceError,
)
from llmgw.engines.common import Adapter, OwnedFlag, resolve_model_path
from llmgw.engines.llamacpp import ADAPTER as _LLAMACPP
from llmgw.engines.sglang import ADAPTER as _SGLANG
from llmgw.engines.vllm import ADAPTER as _VLLM

ENGINES: dict[str, Adapter] = {a.name: a for a in (_VLLM, _SGLANG, _LLAMACPP)}


def get_adapter(engine: str) -> Adapter:
    try:
        return ENGINES[engine]
    except (KeyError, TypeError):
        known = ", ".join(sorted(ENGINES))
        raise ProfileError(f"unknown engine {engine!r}; known engines: {known}") from None


def validate_profile(profile: Profile) -> None:
    """Raise ProfileError listing every problem with ``profile``."""
    get_adapter(profile.engine).validate_profile(profile)


def validate(model: Model, profile: Profile) -> None:
    """Profile checks plus those needing the model (source kind, model-owned flags)."""
    get_adapter(profile.engine).validate(model, profile)


def build_launch(model: Model, profile: Profile, ctx: LaunchContext) -> LaunchSpec:
    return get_adapter(profile.engine).build(model, profile, ctx)


__all__ = [
    "ENGINES",
    "Adapter",
    "LaunchContext",
    "LaunchContextError",
    "LaunchSpec",
    "OwnedFlag",
    "ProfileError",
    "SourceError",
    "build_launch",
    "get_adapter",
    "resolve_model_path",
    "validate",
    "validate_profile",
]
