"""The fleet simulator reaches the agent only through its public seams.

The simulator produces every fleet-size figure by running the agent's own
``Supervisor`` and ``StreamClient``.  Were it to override or call their private
members, any edit to the agent would silently change what the simulator
measures; so it plugs in an engine driver (``llmgw.agent.driver``), uses the
client's public hooks, and implements the state-directory protocol, and these
tests fail by name on the first private member it names.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import llmgw.sim
from llmgw.agent.popendriver import PopenDriver
from llmgw.agent.statedir import StateDir
from llmgw.agent.stream import StreamClient
from llmgw.agent.supervisor import Supervisor

GUARDED = (Supervisor, StreamClient, StateDir, PopenDriver)  # the driver the simulator hands real engines


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_members(cls: type) -> set[str]:
    """Private names a class or its llmgw bases define: methods, class attributes and ``self._x`` ones."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("llmgw."):
            continue
        names |= {n for n in vars(klass) if is_private(n)}
        tree = ast.parse(inspect.getsource(klass))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                    and is_private(node.attr)):
                names.add(node.attr)
    return names


def sim_modules() -> list[tuple[str, Path]]:
    root = Path(llmgw.sim.__file__).parent
    mods = [("llmgw.sim", root / "__init__.py")]
    for info in pkgutil.walk_packages([str(root)], prefix="llmgw.sim."):
        spec = importlib.util.find_spec(info.name)
        assert spec is not None and spec.origin is not None
        mods.append((info.name, Path(spec.origin)))
    return mods


def violations() -> list[str]:
    private = set().union(*(private_members(c) for c in GUARDED))
    found: list[str] = []
    for name, path in sim_modules():
        module = importlib.import_module(name)
        tree = ast.parse(path.read_text(), str(path))

        def guarded_subclass(cls_name: str) -> type | None:
            obj = getattr(module, cls_name, None)
            if isinstance(obj, type):
                for base in GUARDED:
                    if issubclass(obj, base):
                        return base
            return None

        def visit(node: ast.AST, enclosing: str | None) -> None:
            if isinstance(node, ast.ClassDef):
                base = guarded_subclass(node.name)
                if base is not None:
                    for item in node.body:
                        targets = ([item.name] if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                                   else [t.id for t in getattr(item, "targets", [getattr(item, "target", None)])
                                         if isinstance(t, ast.Name)])
                        for t in targets:
                            if is_private(t) and hasattr(base, t):
                                found.append(f"{path.name}:{item.lineno}: {node.name} overrides "
                                             f"{base.__name__}.{t}")
                for child in ast.iter_child_nodes(node):
                    visit(child, node.name)
                return
            if isinstance(node, ast.Attribute) and node.attr in private:
                own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                # ``self._x`` of the simulator's own classes is theirs; of a subclass of the agent's, it is the agent's.
                if not own or (enclosing is not None and guarded_subclass(enclosing) is not None):
                    found.append(f"{path.name}:{node.lineno}: names {ast.unparse(node)}")
            for child in ast.iter_child_nodes(node):
                visit(child, enclosing)

        visit(tree, None)
    return found


def test_the_simulator_names_no_private_member_of_the_supervisor_stream_client_state_dir_or_driver() -> None:
    assert violations() == []


def test_the_scan_sees_what_it_must_refuse() -> None:
    """The rule itself: the names the supervisor's lifecycle is made of are among those it guards."""
    private = set().union(*(private_members(c) for c in GUARDED))
    assert {"_transition", "_conclude", "_end", "_tail", "_queue", "_handle_text", "_connect_once"} <= private
    assert "_session" not in private_members(Supervisor)  # the probes' session is the driver's now


def test_state_dirs_implement_the_store_protocol_with_its_signatures() -> None:
    """A keyword the supervisor passes (``since_offset``) must be one every state dir takes."""
    from llmgw.agent.statedir import ShardStore
    from llmgw.sim.fleet.shards import SimStateDir

    members = [n for n, v in vars(ShardStore).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert {"write", "remove", "log_note", "log_tail", "open_log", "secret_dir", "remove_secrets"} <= set(members)
    for cls in (StateDir, SimStateDir):
        assert ShardStore in cls.__mro__, f"{cls.__name__} does not declare ShardStore"
        for n in members:
            want = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(ShardStore, n)).parameters.values()]
            got = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(cls, n)).parameters.values()]
            assert got == want, f"{cls.__name__}.{n}"
        assert isinstance(inspect.getattr_static(cls, "root", None), property) or cls is StateDir
