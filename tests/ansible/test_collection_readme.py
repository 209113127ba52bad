"""The collection's README names everything the collection ships: every role, module and
playbook (an operator reads it before ``ansible-doc``; a role missing there is a role
nobody finds)."""

from __future__ import annotations

import pytest

from fleet_harness import REPO

COLLECTION = REPO / "collections" / "ansible_collections" / "llmgw" / "fleet"
README = (COLLECTION / "README.md").read_text()
ROLES = sorted(p.name for p in (COLLECTION / "roles").iterdir() if p.is_dir())
MODULES = sorted(p.stem for p in (COLLECTION / "plugins" / "modules").glob("*.py") if p.stem != "__init__")
REPO_PLAYBOOKS = sorted(p.name for p in (REPO / "playbooks").glob("*.yml"))


@pytest.mark.parametrize("role", ROLES)
def test_every_role_is_in_the_readme(role):
    assert f"`llmgw.fleet.{role}`" in README


@pytest.mark.parametrize("module", MODULES)
def test_every_module_is_in_the_readme(module):
    assert f"`llmgw.fleet.{module}`" in README


@pytest.mark.parametrize("playbook", REPO_PLAYBOOKS)
def test_every_playbook_is_in_the_readme(playbook):
    assert f"`playbooks/{playbook}`" in README


def test_the_licence_text_ships_with_the_collection():
    assert "GNU GENERAL PUBLIC LICENSE" in (COLLECTION / "COPYING").read_text()
