"""Every configuration default is the schema's (``llmgw.schemadefaults``).

The schemas state the defaults (and docs/configuration.md shows them); the
parsers fill absent keys from them.  The settings dataclasses keep field
defaults for code that builds them directly, so each one is held here to
the schema's default for the same key, naming the one that drifted; and the
parsers may not state a default of their own as a ``.get(key, literal)``.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from llmgw import catalog, settings
from llmgw.router import settings as router_settings
from llmgw.schemadefaults import section_defaults, with_defaults

ROOT = Path(__file__).resolve().parents[2]
PARSERS = [ROOT / "agent/llmgw/settings.py", ROOT / "agent/llmgw/router/settings.py",
           ROOT / "agent/llmgw/catalog.py"]

# (dataclass, schema, section it is built from, {field: (section, key) where they differ})
TABLE = [
    (settings.Lifecycle, "server", "/lifecycle", {}),
    (settings.RestartPolicy, "server", "/restart", {}),
    (settings.EjectionPolicy, "server", "/router_ejections", {}),
    (settings.RouterAllowance, "server", "/router_allowance", {}),
    (settings.ApiClients, "server", "/api/clients", {}),
    (settings.HASettings, "server", "/ha", {"prefix": ("/ha/etcd", "prefix")}),
    (catalog.Profile, "server", "/profiles/[]", {}),
    (catalog.Autoscale, "server", "/deployments/[]/autoscale", {}),
    (catalog.Sleep, "server", "/deployments/[]/autoscale/sleep", {}),
    (settings.FetchPolicy, "agent", "/fetch", {}),
    (settings.LivenessPolicy, "agent", "/health", {}),
    (settings.EngineTLS, "agent", "/engine_tls", {}),
    (settings.AgentSettings, "agent", "", {"rediscover_interval": ("/discovery", "interval")}),
    (router_settings.RouterSettings, "router", "",
     {"host": ("/listen", "host"), "port": ("/listen", "port"), "backlog": ("/listen", "backlog")}),
    (router_settings.Timeouts, "router", "/timeouts", {}),
    (router_settings.Limits, "router", "/limits", {}),
    (router_settings.Clients, "router", "/clients", {}),
    (router_settings.Disaggregation, "router", "/disaggregation", {}),
    (router_settings.Balancing, "router", "/balancing", {}),
    (router_settings.CacheAware, "router", "/balancing/cache_aware", {}),
    (router_settings.Retries, "router", "/retries", {}),
    (router_settings.Outlier, "router", "/outlier", {}),
    (router_settings.Hold, "router", "/hold", {}),
    (router_settings.KeyLimits, "router", "/api_keys/[]/limits", {}),
    (router_settings.Allowance, "router", "/allowance", {}),
]


def _value_default(f: dataclasses.Field):
    """A field's default when it is a value (not absent-means-None, empty, or a nested dataclass)."""
    if f.default is dataclasses.MISSING:
        return dataclasses.MISSING
    d = f.default
    if d is None or d == () or d == "" or dataclasses.is_dataclass(d):
        return dataclasses.MISSING
    return d


def _same(a, b) -> bool:
    norm = (lambda v: list(v) if isinstance(v, (tuple, list)) else v)
    return type(a) is not bool and type(b) is not bool and norm(a) == norm(b) or a is b


@pytest.mark.parametrize("cls, schema, section, renames", TABLE, ids=[t[0].__qualname__ for t in TABLE])
def test_dataclass_defaults_are_the_schemas(cls, schema, section, renames):
    compared = 0
    for f in dataclasses.fields(cls):
        where, key = renames.get(f.name, (section, f.name))
        stated = section_defaults(schema, where)
        mine = _value_default(f)
        if key in stated and mine is dataclasses.MISSING:
            continue  # the parser always passes it, from the filled document
        if key in stated:
            compared += 1
            assert _same(mine, stated[key]), (
                f"{cls.__qualname__}.{f.name} = {mine!r} but {schema}.schema.json {where}/{key} "
                f"says default {stated[key]!r}: state it once, in the schema")
        else:
            assert mine is dataclasses.MISSING, (
                f"{cls.__qualname__}.{f.name} = {mine!r} has no default in {schema}.schema.json {where}/{key}: "
                "state it there (docs/configuration.md shows it) and let the parser fill it")
    assert compared, f"{cls.__qualname__}: no key of {schema}{section} has a default (wrong section?)"


def test_every_settings_dataclass_with_value_defaults_is_held():
    """A new settings dataclass with defaults of its own is held too, not forgotten."""
    held = {t[0] for t in TABLE}
    for module in (settings, router_settings, catalog):
        for obj in vars(module).values():
            if dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__ and obj not in held:
                own = [f.name for f in dataclasses.fields(obj) if _value_default(f) is not dataclasses.MISSING]
                assert not own, f"{obj.__qualname__} has defaults {own}: add it to TABLE with its schema section"


def _literal_get_defaults(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)):
            default = node.args[1]
            empty = isinstance(default, (ast.Tuple, ast.List, ast.Dict)) and not (
                getattr(default, "elts", None) or getattr(default, "keys", None))
            if isinstance(default, (ast.Constant, ast.Tuple, ast.List, ast.Dict, ast.Attribute)) and not empty \
                    and not (isinstance(default, ast.Constant) and default.value is None):
                yield f"{path.name}:{node.lineno}: .get({node.args[0].value!r}, {ast.unparse(default)})"


def test_the_parsers_state_no_default_of_their_own():
    found = [hit for path in PARSERS for hit in _literal_get_defaults(path)]
    assert not found, "defaults stated at parse time (put them in the schema): " + "; ".join(found)


def test_absent_sections_are_filled_from_the_schema():
    """What the parsers read: a file without a section gets the schema's section, nested defaults and all."""
    doc = with_defaults({"node_id": "n1", "state_dir": "/s", "control_plane": {"url": "wss://cp"}}, "agent")
    assert doc["health"] == section_defaults("agent", "/health")
    assert doc["engine_ports"] == {"first": 20000, "last": 20999}
    assert doc["control_plane"]["reconnect_max"] == section_defaults("agent", "/control_plane")["reconnect_max"]
    assert "engine_tls" not in doc  # its absence means plain HTTP: no default section
    router = with_defaults({"timeouts": {"total": 5}}, "router")
    assert router["timeouts"] == {**section_defaults("router", "/timeouts"), "total": 5}
    server = with_defaults({"router": {}, "profiles": [{"name": "p", "engine": "vllm"}]}, "server")
    assert server["router"]["listen"]["port"] == section_defaults("router", "/listen")["port"]
    assert server["profiles"][0]["start_timeout"] == section_defaults("server", "/profiles/[]")["start_timeout"]


def test_a_refused_document_is_left_for_the_schema_to_name():
    assert with_defaults({"health": "often"}, "agent")["health"] == "often"
    assert with_defaults(["not", "a", "mapping"], "agent") == ["not", "a", "mapping"]


def test_parsed_settings_use_a_changed_schema_default(monkeypatch):
    """The parser reads the schema, not a number of its own: change the schema and the settings follow."""
    import copy

    from llmgw import config

    agent = copy.deepcopy(config.load_schema("agent"))
    agent["properties"]["discovery"]["properties"]["interval"]["default"] = 7
    real = config.load_schema
    monkeypatch.setattr("llmgw.schemadefaults.load_schema", lambda name: agent if name == "agent" else real(name))
    parsed = settings.parse_agent_settings({"node_id": "n1", "state_dir": "/s", "insecure_no_tls": True,
                                            "control_plane": {"url": "ws://127.0.0.1:1"}})
    assert parsed.rediscover_interval == 7
