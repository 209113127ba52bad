"""Flag drift: every flag an adapter emits or owns exists in the pinned engine release.

Adapters are written from the engines' documentation; nothing else in the suite
parses their argv with the real parser, so a renamed or removed flag would pass
every other test and fail every launch in production. Here the engines' own
definitions are the reference:

- llama.cpp: ``llama-server --help`` of the binary built by
  ``tests/engines/build-llama-server`` (the flags and the ``LLAMA_ARG_*`` variables);
- vLLM and SGLang: their argument definitions read statically with ``ast`` from the
  pinned release's source (``tests/engines/fetch-engine-source``), never imported
  (no torch): every literal flag given to ``add_argument``; for vLLM also the fields of
  ``FrontendArgs`` and its base class, which ``add_cli_args`` turns into ``--field-name``;
  for SGLang (0.5.20 and later) the annotated fields of the namespace classes that
  ``server_args.py`` assembles ``ServerArgs`` from (``_INPUT_NAMESPACES``), which
  ``add_cli_args_from_dataclass`` turns into ``--field-name`` (or the ``Arg``'s
  ``cli_name``) plus its ``aliases``, skipping ``no_cli`` fields.

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
from llmgw.engines.common import find_owned
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
    if engine == "vllm":  # the api_server module takes the model as --model
        cases.append((Profile("one", engine), LaunchContext(**HTTP, model_path=model_path, gpu_indices=(0,), command=(
            "python", "-m", "vllm.entrypoints.openai.api_server"))))
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


def add_argument_groups(tree: ast.AST) -> list[set[str]]:
    """The spellings of each ``*.add_argument(...)`` call: its string literals starting with '-'."""
    groups = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            group = {a.value for a in node.args
                     if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("-")}
            if group:
                groups.append(group)
    return groups


def add_argument_flags(tree: ast.AST) -> set[str]:
    """Every string literal starting with '-' passed positionally to any ``*.add_argument(...)`` call."""
    return set().union(*add_argument_groups(tree))


def dataclass_field_flags(tree: ast.AST, cls: str) -> set[str]:
    """``--field-name`` for each annotated field of class ``cls`` and of its bases defined in the same
    module (vLLM derives these flags from the fields, inherited ones included)."""
    classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    if cls not in classes:
        raise AssertionError(f"no class {cls}")
    node = classes[cls]
    flags = {"--" + s.target.id.replace("_", "-") for s in node.body
             if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            flags |= dataclass_field_flags(tree, base.id)
    return flags


def annotated_field_flags(node: ast.ClassDef) -> set[str]:
    return set().union(*annotated_field_groups(node))


def annotated_field_groups(node: ast.ClassDef) -> list[set[str]]:
    """The flags SGLang's ``add_cli_args_from_dataclass`` registers for the fields of ``node``.

    A field ``name: A[T, <help>]`` or ``A[T, Arg(...)]`` becomes ``--name`` (or ``Arg(cli_name=...)``)
    plus ``Arg(aliases=[...])``; a field without help or ``Arg``, or with ``Arg(no_cli=True)``, has none.
    Any metadata that is not a call (a string, ``argparse.SUPPRESS``) is help text; other calls
    (``NS(...)``) are markers.
    """
    groups: list[set[str]] = []
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        ann = stmt.annotation
        if not (isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name)
                and ann.value.id in ("A", "Annotated") and isinstance(ann.slice, ast.Tuple)):
            continue
        meta = None
        for el in ann.slice.elts[1:]:
            if isinstance(el, ast.Call):
                if isinstance(el.func, ast.Name) and el.func.id == "Arg":
                    meta = el
                    break
                continue
            meta = el
            break
        if meta is None:
            continue
        name = "--" + stmt.target.id.replace("_", "-")
        names: set[str] = set()
        if isinstance(meta, ast.Call):
            kw = {k.arg: k.value for k in meta.keywords}
            if isinstance(kw.get("no_cli"), ast.Constant) and kw["no_cli"].value is True:
                continue
            if isinstance(kw.get("cli_name"), ast.Constant):
                name = kw["cli_name"].value
            if isinstance(kw.get("aliases"), (ast.List, ast.Tuple)):
                names |= {e.value for e in kw["aliases"].elts if isinstance(e, ast.Constant)}
        groups.append({name} | names)
    return groups


def namespace_classes(tree: ast.AST, root: Path) -> list[tuple[ast.ClassDef, ast.AST]]:
    """The classes listed in ``_INPUT_NAMESPACES`` of SGLang's server_args.py, found through its imports."""
    listed: list[str] = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES"
                                                 for t in node.targets)):
            listed = [e.id for e in node.value.elts if isinstance(e, ast.Name)]
    assert listed, "server_args.py no longer assembles ServerArgs from _INPUT_NAMESPACES"
    modules = {a.asname or a.name: n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
               for a in n.names}
    found = []
    for name in listed:
        assert name in modules, f"server_args.py does not import {name}"
        module = parse(root / (modules[name].replace(".", "/") + ".py"))
        cls = next((n for n in ast.walk(module) if isinstance(n, ast.ClassDef) and n.name == name), None)
        assert cls is not None, f"{modules[name]} defines no class {name}"
        found.append((cls, module))
    return found


def parse(path: Path) -> ast.AST:
    assert path.is_file(), f"{path} is not in the pinned release: the drift check must follow the engine's layout"
    return ast.parse(path.read_text(), str(path))


def vllm_groups() -> list[set[str]]:
    """The spellings of each flag of the pinned vLLM's ``vllm serve``."""
    root = source("vllm") / "vllm"
    engine = parse(root / "engine/arg_utils.py")
    serve = parse(root / "entrypoints/common/cli_args.py")
    frontend = dataclass_field_flags(serve, "FrontendArgs")
    assert "--port" in frontend and "--host" in frontend, "FrontendArgs no longer defines the HTTP flags"
    return add_argument_groups(engine) + add_argument_groups(serve) + [{f} for f in frontend]


def sglang_groups() -> list[set[str]]:
    """The spellings of each flag of the pinned SGLang's ``launch_server``."""
    root = source("sglang")
    server_args = parse(root / "sglang/srt/server_args.py")
    groups = add_argument_groups(server_args)
    for cls, _ in namespace_classes(server_args, root):
        groups += annotated_field_groups(cls)
    flags = set().union(*groups)
    assert "--port" in flags and "--host" in flags, "the namespace classes no longer define the HTTP flags"
    return groups


def vllm_flags() -> set[str]:
    return set().union(*vllm_groups())


def sglang_flags() -> set[str]:
    return set().union(*sglang_groups())


def test_static_reading_finds_literal_flags_and_dataclass_fields():
    tree = ast.parse("p.add_argument('--a-b', '-x', type=int)\ng.add_argument(f'--{k}', **v)\n"
                     "class BaseFrontendArgs:\n    chat_template: str = None\n"
                     "class FrontendArgs(BaseFrontendArgs):\n    host: str = None\n    allowed_origins: list = None\n"
                     "    X = 1\n")
    assert add_argument_flags(tree) == {"--a-b", "-x"}
    assert dataclass_field_flags(tree, "FrontendArgs") == {"--host", "--allowed-origins", "--chat-template"}
    assert missing({"--no-a-b", "--c", "-x"}, {"--a-b", "-x"}) == ["--c"]


def test_static_reading_follows_sglang_annotated_fields():
    cls = ast.parse(
        "class Parallel(msgspec.Struct):\n"
        "    _NS_PATH = 'parallel'\n"
        "    tp_size: A[int, Arg(help='tp', aliases=['--tensor-parallel-size'], cli_name='--tp-size')] = 1\n"
        "    port: A[int, 'The port.'] = 30000\n"
        "    kv_events_config: A[Optional[str], 'help ' 'joined'] = None\n"
        "    hidden: A[int, Arg(no_cli=True)] = 0\n"
        "    marked: A[int, NS('x'), 'help'] = 0\n"
        "    plain: int = 0\n"
        "    bare: A[int, NS('x')] = 0\n"
    ).body[0]
    assert annotated_field_flags(cls) == {"--tp-size", "--tensor-parallel-size", "--port", "--kv-events-config",
                                          "--marked"}


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


# Profiles under which an adapter owns the most (multi-node adds vLLM's executor backend).
def all_owned(engine: str) -> tuple:
    adapter = get_adapter(engine)
    profile = Profile("mn", engine, tensor_parallel_size=2, nodes=2)
    return adapter.owned_flags(profile) + adapter.key_flags


@pytest.mark.parametrize("engine, groups", [("vllm", vllm_groups), ("sglang", sglang_groups)])
def test_every_spelling_the_release_accepts_for_an_owned_flag_is_owned(engine, groups):
    """A release that adds an alias (vLLM 0.33's ``-dpm``) would otherwise let a profile set an owned flag."""
    short = []
    for flag in all_owned(engine):
        for group in groups():
            if group & set(flag.spellings) and not group <= set(flag.spellings):
                short.append(f"{flag.name}: {sorted(group - set(flag.spellings))}")
    assert not short, f"{engine} {version(engine.upper())} accepts spellings the adapter leaves free: {short}"


@pytest.mark.parametrize("engine, flags", [("vllm", vllm_flags), ("sglang", sglang_flags)])
def test_no_flag_the_adapter_leaves_free_reads_as_an_owned_one(engine, flags):
    """Abbreviations are matched by prefix: a free flag that is a prefix of an owned one (``--grpc`` of
    ``--grpc-port``) would be refused in its own name, which argparse itself never does."""
    adapter = get_adapter(engine)
    owned = all_owned(engine)
    spellings = {s for f in owned for s in f.spellings}
    wrong = {f: hits[0][2].name for f in sorted(flags() - spellings)
             if (hits := find_owned([f], owned, adapter.syntax))}
    assert not wrong, f"{engine} {version(engine.upper())}: free flags read as owned ones: {wrong}"


@pytest.mark.parametrize("engine, groups", [("vllm", vllm_groups), ("sglang", sglang_groups)])
def test_the_memory_share_is_read_under_every_spelling_the_release_accepts(engine, groups):
    adapter = get_adapter(engine)
    ours = {adapter.memory_fraction_flag, *adapter.memory_fraction_aliases}
    (group,) = [g for g in groups() if adapter.memory_fraction_flag in g]
    assert group == ours, f"{engine} {version(engine.upper())} spells the memory share {sorted(group)}"
