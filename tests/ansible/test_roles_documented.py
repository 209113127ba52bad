"""Every role of llmgw.fleet is documented the way Ansible reads it: a README.md,
and a meta/argument_specs.yml (what ``ansible-doc -t role`` shows and what Ansible
checks a role's variables against when it starts) that documents every variable
its defaults/main.yml sets, with the same default.

Most roles have no defaults of their own: they depend on llmgw.fleet.llmgw, whose
defaults every role shares. A role that documents one of those shared variables
must give it the default the shared role really sets.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml

from fleet_harness import BIN, REPO

ROLES_DIR = REPO / "collections" / "ansible_collections" / "llmgw" / "fleet" / "roles"
ROLES = sorted(p.name for p in ROLES_DIR.iterdir() if p.is_dir())


def _yaml(path):
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def _defaults(role):
    return _yaml(ROLES_DIR / role / "defaults" / "main.yml") or {}


def _options(role):
    spec = _yaml(ROLES_DIR / role / "meta" / "argument_specs.yml") or {}
    return ((spec.get("argument_specs") or {}).get("main") or {}).get("options") or {}


def _dependencies(role):
    deps = (_yaml(ROLES_DIR / role / "meta" / "main.yml") or {}).get("dependencies") or []
    names = [d["role"] if isinstance(d, dict) else d for d in deps]
    return [n.rsplit(".", 1)[-1] for n in names if n.startswith("llmgw.fleet.")]


def _same_default(documented, actual):
    """A literal default must be documented as it is; a templated one may be documented
    by what it evaluates from (``~/.local/share/llmgw/pki`` for ``{{ '~/...' | expanduser }}``)."""
    if documented == actual:
        return True
    return isinstance(actual, str) and "{{" in actual and isinstance(documented, str) and documented in actual


def test_the_collection_has_the_roles_this_test_walks():
    assert {"agent", "control_plane", "fabric", "llmgw", "pki", "preflight"} <= set(ROLES)


@pytest.mark.parametrize("role", ROLES)
def test_the_role_has_a_readme_and_argument_specs(role):
    readme = ROLES_DIR / role / "README.md"
    assert readme.is_file(), f"{role}: no README.md"
    assert readme.read_text().startswith(f"# llmgw.fleet.{role}\n"), f"{role}: README.md does not start with its name"
    spec = _yaml(ROLES_DIR / role / "meta" / "argument_specs.yml")
    assert spec is not None, f"{role}: no meta/argument_specs.yml"
    main = spec["argument_specs"]["main"]
    assert main.get("short_description") and main.get("description"), f"{role}: argument_specs main is not described"
    for name, option in _options(role).items():
        assert option.get("description"), f"{role}: option {name} has no description"
        assert option.get("type"), f"{role}: option {name} has no type"


@pytest.mark.parametrize("role", ROLES)
def test_every_default_is_documented_with_its_value(role):
    options = _options(role)
    undocumented = sorted(set(_defaults(role)) - set(options))
    assert undocumented == [], f"{role}: defaults/main.yml sets variables meta/argument_specs.yml does not document"
    wrong = {name: (options[name]["default"], value) for name, value in _defaults(role).items()
             if "default" in options[name] and not _same_default(options[name]["default"], value)}
    assert wrong == {}, f"{role}: documented default (first) differs from defaults/main.yml (second)"


@pytest.mark.parametrize("role", ROLES)
def test_a_documented_default_is_one_the_role_or_its_dependencies_set(role):
    inherited = {}
    for dep in _dependencies(role):
        inherited.update(_defaults(dep))
    inherited.update(_defaults(role))
    invented = sorted(name for name, option in _options(role).items() if "default" in option and name not in inherited)
    assert invented == [], f"{role}: documents a default for variables no defaults/main.yml sets"
    wrong = {name: (option["default"], inherited[name]) for name, option in _options(role).items()
             if "default" in option and not _same_default(option["default"], inherited[name])}
    assert wrong == {}, f"{role}: documented default (first) differs from the one its dependency sets (second)"


def test_ansible_doc_reads_every_role():
    out = subprocess.run(
        [str(BIN / "ansible-doc"), "-t", "role", "--json", *(f"llmgw.fleet.{r}" for r in ROLES)],
        check=True, capture_output=True, text=True, cwd=REPO,
        env={**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg")},
    )
    docs = json.loads(out.stdout)
    assert sorted(docs) == sorted(f"llmgw.fleet.{r}" for r in ROLES)
    for name, doc in docs.items():
        assert "main" in doc["entry_points"], name
