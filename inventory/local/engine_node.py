"""The inventory of the local fleet's CPU node, which runs one real engine beside the simulated ones.

`make quickstart ENGINE=llamacpp|vllm` passes the file this writes to site.yml as a second
inventory (`-i`): it adds the node `local-cpu0` to `llmgw_agents` and defines
`llmgw_local_engine`, from which `group_vars/all/fleet.yml` adds the engine's model, its
profile and one replica to the catalog, and `group_vars/llmgw_agents/node.yml` gives that
node alone the engine's command.

Why a node of its own: an agent's `engines` maps each engine kind to one command, and on
`local-gpu0` `vllm` is the simulator. A real vLLM needs another agent whose `vllm` is the real
one. Placement has no node selector, so the node keeps the simulated replicas out by
memory: its one card (placement reserves a GPU for every replica; the engine itself runs on
the CPU) is too small for any of the simulated models, while the generated model declares
no size and fits anywhere. The simulated replicas fill `local-gpu0` and come first in the
catalog; the real engine's replica, last, goes to `local-cpu0`. llama.cpp takes the same
path, so the quickstart has one way to add a real engine.

    python inventory/local/engine_node.py vllm OUT --model DIR -- PYTHON -m vllm.entrypoints.openai.api_server
    python inventory/local/engine_node.py llamacpp OUT --model FILE --sha256 HEX -- LLAMA_SERVER
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from llmgw.durable import write_atomic

NODE = "local-cpu0"
INVENTORY = Path(__file__).resolve().parent

# vLLM's CPU build on a machine of a few shared cores: one OpenMP thread, unbound, a 1 GiB KV
# space, the CPU platform, nothing fetched from the hub, no usage reports (the settings
# tests/engines/vllmcpu.py runs it with; tests/unit/test_quickstart_engine_node.py keeps them equal).
VLLM_CPU_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_TARGET_DEVICE": "cpu", "PYTHONUNBUFFERED": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# The CPU attention backend needs float32 and a block size that is a multiple of 32; a short
# context keeps the KV space the engine reserves small.
VLLM_CPU_ARGS = ["--dtype", "float32", "--block-size", "32", "--max-num-seqs", "4", "--max-model-len", "512"]


def engine_spec(engine: str, command: list[str], model: str, sha256: str | None) -> dict:
    """`llmgw_local_engine`: the node, its engine command, and the catalog entries it serves."""
    if not command:
        raise ValueError("the engine command is empty")
    if engine == "llamacpp":
        if not sha256:
            raise ValueError("llamacpp: the GGUF file's --sha256 is required")
        entry = {"name": "tiny-llama", "source": model, "sha256": sha256}
        profile = {"name": "llamacpp-cpu", "engine": "llamacpp", "start_timeout": 120}
    elif engine == "vllm":
        entry = {"name": "tiny-llama-hf", "source": model}  # a directory: no single digest
        # Loading and compiling on two shared cores takes minutes, not the one it takes alone.
        profile = {"name": "vllm-cpu", "engine": "vllm", "env": dict(VLLM_CPU_ENV),
                   "extra_args": list(VLLM_CPU_ARGS), "start_timeout": 600}
    else:
        raise ValueError(f"unknown engine {engine!r}: llamacpp or vllm")
    return {"node": NODE, "engine": engine, "command": list(command), "model": entry, "profile": profile}


def node_inventory(spec: dict, inventory: Path = INVENTORY) -> dict:
    """The inventory document: the node in llmgw_agents, the spec for every host.

    The node's files are found from inventory/local (`_local_inventory`), not from the
    directory of this generated file; site.yml's final wait covers the engine's start.
    """
    wait = int(spec["profile"].get("start_timeout", 900)) // 2 + 60  # polls 2 s apart
    return {"all": {"vars": {"llmgw_local_engine": spec, "llmgw_verify_retries": wait},
                    "children": {"llmgw_agents": {"hosts": {spec["node"]: {"_local_inventory": str(inventory)}}}}}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("engine", choices=("llamacpp", "vllm"))
    p.add_argument("out", type=Path)
    p.add_argument("--model", required=True, help="absolute path of the model (file or directory)")
    p.add_argument("--sha256", help="digest of a single-file model")
    p.add_argument("command", nargs="+", help="the engine command, after --")
    a = p.parse_args(argv)
    model = Path(a.model)
    if not model.is_absolute() or not model.exists():
        p.error(f"--model {a.model}: not an existing absolute path")
    try:
        spec = engine_spec(a.engine, a.command, str(model), a.sha256)
    except ValueError as e:
        p.error(str(e))
    head = f"# Written by `make {a.engine}-vars` (inventory/local/engine_node.py); regenerated on every run.\n"
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(a.out, (head + yaml.safe_dump(node_inventory(spec), sort_keys=False)).encode(), mode=0o644)
    return 0


if __name__ == "__main__":
    sys.exit(main())
