"""Flag drift: every flag an adapter emits or owns exists in the pinned engine release.

Adapters are written from the engines' documentation; nothing else in the suite
parses their argv with the real parser, so a renamed or removed flag would pass
every other test and fail every launch in production. Here the engines' own
definitions are the reference:

- llama.cpp: ``llama-server --help`` of the binary built by
  ``tests/engines/build-llama-server`` (the flags and the ``LLAMA_ARG_*`` variables);
- vLLM and SGLang: their argument definitions read statically with ``ast`` from the
  pinned release's source (``tests/engines/fetch-engine-source``), never imported
  (no torch): every literal flag given to ``add_argument``, and for vLLM the fields of
  ``FrontendArgs``, which ``FrontendArgs.add_cli_args`` turns into ``--field-name``.

Versions are pinned in ``tests/engines/versions``; ``make test`` builds and fetches
first, so these checks skip (saying how to get the reference) only when run alone.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from llmgw.catalog import Model, Profile
from llmgw.engines import LaunchContext, get_adapter
from pinned import engine_source, llama_server, version

# (profile, context) pairs covering every branch of the adapters' argv: one GPU,
# tensor and pipeline parallel, a context length, both ranks of a two-node shard.
HTTP = dict(host="127.0.0.1", port=8000)


def _cases(engine: str, model_path: str) -> list[tuple[Profile, LaunchContext]]:
    cases = [
        (Profile("one", engine), LaunchContext(**HTTP, model_path=model_path, gpu_indices=(0,))),
        (Profile("tp", engine, tensor_parallel_size=2), LaunchContext(**HTTP, model_path=model_path, gpu_indices=(0, 1))),
        # the node's engine certificate: HTTPS where the adapter can serve it
        (Profile("tls", engine), LaunchContext(**HTTP, model_path=model_path, gpu_indices=(0,),
                                               tls_cert="/etc/llmgw/engine.crt", tls_key="/etc/llmgw/engine.key")),
    ]
    if engine != "llamacpp":
        pp = Profile("pp", engine, tensor_parallel_size=2, pipeline_parallel_size=2)
        cases.append((pp, LaunchContext(**HTTP, model_path=model_path, gpu_indices=(0, 1, 2, 3))))
        multi = Profile("mn", engine, tensor_parallel_size=4, nodes=2)
        for rank in (0, 1):
            cases.append((multi, LaunchContext(**HTTP, model_path=model_path, rank=rank, nnodes=2, master_addr="10.0.0.1",
                                               master_port=29501, gpu_indices=(0, 1))))
    return cases


def adapter_flags(engine: str, model: Model) -> tuple[set[str], set[str]]:
    """(flags the adapter puts in argv, flags it owns) over every case."""
    adapter = get_adapter(engine)
    emitted: set[str] = set()
    owned: set[str] = set()
    for profile, ctx in _cases(engine, model.source):
        argv = adapter.engine_args(model, profile, ctx)
        emitted |= {t.split("=", 1)[0] for t in argv if re.match(r"^--?[A-Za-z]", t)}
        owned |= {s for f in adapter.owned_flags(profile) for s in f.spellings}
    owned |= {s for f in adapter.model_owned_flags(model) for s in f.spellings}
    return emitted, owned


def missing(flags: set[str], known: set[str]) -> list[str]:
    """Flags not in ``known``; ``--no-X`` counts as known when ``--X`` is (argparse's BooleanOptionalAction)."""
    return sorted(f for f in flags if f not in known and not (f.startswith("--no-") and "--" + f[5:] in known))


# ------------------------------------------------------------------- llama.cpp

def llama_help() -> str:
    binary = llama_server()
    if binary is None:
        pytest.skip(f"llama-server {version('LLAMA_CPP_PYTHON')} is not built: run tests/engines/build-llama-server "
                    "(make test does)")
    res = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout + res.stderr


def help_flags(text: str) -> set[str]:
    """Flags in the option column of ``--help`` (lines starting with a dash; spellings split by ", ")."""
    flags: set[str] = set()
    for line in text.splitlines():
        m = re.match(r"^(-[^\s,]+(?:,\s*-[^\s,]+)*)", line.strip())
        if m:
            flags |= {s.strip() for s in m.group(1).split(",")}
    return flags


def test_help_parsing_reads_every_spelling_of_an_option_line():
    text = "-ngl,  --gpu-layers, --n-gpu-layers N   max. number of layers (env: LLAMA_ARG_N_GPU_LAYERS)\n" \
           "--host HOST                          ip address to listen\n" \
           "   see --foo in the text, not an option\n"
    assert help_flags(text) == {"-ngl", "--gpu-layers", "--n-gpu-layers", "--host"}


def test_llamacpp_adapter_flags_exist_in_the_built_llama_server():
    known = help_flags(llama_help())
    assert len(known) > 100, "the help output was not parsed"
    model = Model("tiny", "/models/tiny.gguf", "tiny", max_model_len=4096)
    emitted, owned = adapter_flags("llamacpp", model)
    assert not missing(emitted, known), f"llama-server {version('LLAMA_CPP_PYTHON')} lacks flags the adapter passes"
    assert not missing(owned, known), f"llama-server {version('LLAMA_CPP_PYTHON')} lacks flags the adapter owns"


def test_llamacpp_forbidden_environment_variables_exist_in_the_built_llama_server():
    named = set(re.findall(r"\bLLAMA_ARG_[A-Z0-9_]+", llama_help()))
    absent = sorted(set(get_adapter("llamacpp").forbidden_env) - named)
    assert not absent, f"llama-server {version('LLAMA_CPP_PYTHON')} reads no such variables: {absent}"


# ------------------------------------------------------------- vLLM and SGLang

def source(name: str) -> Path:
    root = engine_source(name)
    if root is None:
        pytest.skip(f"{name} {version(name.upper())} source is not fetched: run tests/engines/fetch-engine-source "
                    f"{name} (make test does)")
    return root


def add_argument_flags(tree: ast.AST) -> set[str]:
    """Every string literal starting with '-' passed positionally to any ``*.add_argument(...)`` call."""
    flags = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            for a in node.args:
                if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("-"):
                    flags.add(a.value)
    return flags


def dataclass_field_flags(tree: ast.AST, cls: str) -> set[str]:
    """``--field-name`` for each annotated field of class ``cls`` (vLLM derives these flags from fields)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {"--" + s.target.id.replace("_", "-") for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    raise AssertionError(f"no class {cls}")


def parse(path: Path) -> ast.AST:
    assert path.is_file(), f"{path} is not in the pinned release: the drift check must follow the engine's layout"
    return ast.parse(path.read_text(), str(path))


def vllm_flags() -> set[str]:
    root = source("vllm") / "vllm"
    engine = parse(root / "engine/arg_utils.py")
    serve = parse(root / "entrypoints/openai/cli_args.py")
    frontend = dataclass_field_flags(serve, "FrontendArgs")
    assert "--port" in frontend and "--host" in frontend, "FrontendArgs no longer defines the HTTP flags"
    return add_argument_flags(engine) | add_argument_flags(serve) | frontend


def sglang_flags() -> set[str]:
    return add_argument_flags(parse(source("sglang") / "sglang/srt/server_args.py"))


def test_static_reading_finds_literal_flags_and_dataclass_fields():
    tree = ast.parse("p.add_argument('--a-b', '-x', type=int)\ng.add_argument(f'--{k}', **v)\n"
                     "class FrontendArgs:\n    host: str = None\n    allowed_origins: list = None\n    X = 1\n")
    assert add_argument_flags(tree) == {"--a-b", "-x"}
    assert dataclass_field_flags(tree, "FrontendArgs") == {"--host", "--allowed-origins"}
    assert missing({"--no-a-b", "--c", "-x"}, {"--a-b", "-x"}) == ["--c"]


@pytest.mark.parametrize("engine, known, model", [
    ("vllm", vllm_flags, Model("m", "org/m", "m", max_model_len=4096)),
    ("sglang", sglang_flags, Model("m", "org/m", "m", max_model_len=4096)),
])
def test_adapter_flags_exist_in_the_pinned_release(engine, known, model):
    flags = known()
    assert len(flags) > 100, f"{engine}: too few flags read; the source layout changed"
    emitted, owned = adapter_flags(engine, model)
    pin = f"{engine} {version(engine.upper())}"
    assert not missing(emitted, flags), f"{pin} lacks flags the adapter passes"
    assert not missing(owned, flags), f"{pin} lacks flags the adapter owns"
