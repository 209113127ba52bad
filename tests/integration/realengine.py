"""A fleet whose engines are real: ``llama-server`` or vLLM's CPU build (this module holds no tests).

``engine_fleet`` is one node whose agent's ``engines:`` maps an engine to a real command, so the
agent launches it through that engine's adapter. ``llama_fleet`` runs the binary
``tests/engines/build-llama-server`` built, serving the tiny GGUF model ``tinymodel.write_model``
generates; tests using it skip, naming the command that builds the binary, when it is not there
(``make test`` builds it first, so CI never skips them). The vLLM tests install their engine in a
fixture (``realvllm.vllm_python``) and pass its command to ``engine_fleet``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import openai
import pytest

from llmgw.agent.statedir import StateDir
from fleet import Fleet, edit_agent_config
from pinned import llama_server, version
from tests.support import procfs

LLAMA = llama_server()
needs_llama_server = pytest.mark.skipif(
    LLAMA is None,
    reason=f"llama-server {version('LLAMA_CPP_PYTHON')} is not built: run tests/engines/build-llama-server "
           "(make test does)")


def engine_fleet(root: Path, engine: str, command: list[str], models: list[dict[str, Any]],
                 deployments: list[dict[str, Any]], profiles: list[dict[str, Any]], gpus: int = 2,
                 agent: dict[str, Any] | None = None, sim_nodes: dict[str, int] | None = None,
                 **fleet_kw: Any) -> Fleet:
    """A fleet with a router whose node ``a`` runs ``engine`` as ``command`` (agent.yaml ``engines``);
    ``sim_nodes`` (name -> GPUs) adds nodes whose agents run the simulator, as in every other fleet."""
    f = Fleet(root, nodes={"a": gpus, **(sim_nodes or {})}, router=True, router_http=True, **fleet_kw)
    f.config["models"] = models
    f.config["profiles"] = profiles
    f.config["deployments"] = deployments
    f.write_config()
    edit_agent_config(f.agents["a"], lambda d: d.update(
        engines={engine: command}, model_dir=str(root / "models"), **(agent or {})))
    return f


def llama_fleet(root: Path, models: list[dict[str, Any]], deployments: list[dict[str, Any]],
                profiles: list[dict[str, Any]] | None = None, **kw: Any) -> Fleet:
    """A one-node fleet with a router whose ``llamacpp`` engine is the built ``llama-server``."""
    assert LLAMA is not None
    return engine_fleet(root, "llamacpp", [str(LLAMA)], models, deployments,
                        profiles or [{"name": "cpu", "engine": "llamacpp", "start_timeout": 120}], **kw)


def client(f: Fleet, **kw: Any) -> openai.OpenAI:
    """The official OpenAI client, pointed at the fleet's router."""
    return openai.OpenAI(base_url=f"http://127.0.0.1:{f.router_port}/v1", api_key="unused", max_retries=0,
                         timeout=60, **kw)


def shard_of(f: Fleet, model: str) -> dict[str, Any]:
    (r,) = [r for r in f.replicas()["replicas"] if r["model"] == model and r["state"] == "ready"]
    (s,) = r["shards"]
    return s


def engine_log(f: Fleet, shard_id: str) -> str:
    """The engine's own output, as the agent keeps it in its state dir."""
    path = StateDir(f.root / "a" / "state").log_path(shard_id)
    return path.read_text(errors="replace") if path.exists() else ""


def exe(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/exe")


def cmdline(pid: int) -> list[str]:
    return procfs.argv(pid)


def start_llama_server(model: Path, served_name: str, log_dir: Path, extra_args: tuple[str, ...] = ()):
    """A bare ``llama-server`` (no fleet) launched from the adapter's argv, healthy when returned."""
    import subprocess

    from llmgw.catalog import Model, Profile
    from llmgw.engines import LaunchContext, build_launch
    from simproc import SimProcess

    from tests.support.ports import free_port

    port = free_port()
    spec = build_launch(Model(served_name, str(model), served_name), Profile("cpu", "llamacpp", extra_args=extra_args),
                        LaunchContext(host="127.0.0.1", port=port, model_path=str(model), command=(str(LLAMA),)))
    log_path = log_dir / f"llama-server-{port}.log"
    # An agent starting anywhere on this host kills a `llama-server` no record of its own
    # describes (adoption.engine_evidence), unless the process names another node.
    env = {**os.environ, **spec.env, "LLMGW_NODE_ID": f"bare-llama-server-{os.getpid()}-{port}"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(spec.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    server = SimProcess(proc=proc, port=port, log_path=log_path)
    try:
        server.wait_healthy(60)
    except Exception:
        server.stop()
        raise
    return server
