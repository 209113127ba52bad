"""Run playbooks through ansible-runner the way an operator runs them, and read the results.

Every run uses the repository's ``ansible.cfg`` (collections from ``collections/``
and from the virtualenv's ``ansible`` package) and the virtualenv's
``ansible-playbook``, so what passes here is what ``ansible-playbook`` does from a
clone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ansible_runner

REPO = Path(__file__).resolve().parents[2]
PLAYBOOKS = Path(__file__).resolve().parent / "playbooks"
FIXTURES = REPO / "tests" / "fixtures"
BIN = Path(sys.executable).parent

# ansible-runner looks ansible-playbook up on PATH: make it this virtualenv's.
os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"

# A local inventory for module tests: the controller itself, with this interpreter.
LOCAL_INVENTORY = f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}\n"


@dataclass
class TaskResult:
    host: str
    task: str
    status: str  # ok | failed | skipped | unreachable
    res: dict[str, Any]
    item: Any = None

    @property
    def changed(self) -> bool:
        return bool(self.res.get("changed"))


@dataclass
class PlayResult:
    rc: int
    status: str
    stats: dict[str, dict[str, int]]
    results: list[TaskResult] = field(default_factory=list)
    stdout: str = ""

    def changed(self, host: str | None = None) -> int:
        counts = self.stats.get("changed", {})
        return sum(counts.values()) if host is None else counts.get(host, 0)

    def failures(self) -> int:
        return sum(self.stats.get("failures", {}).values()) + sum(self.stats.get("dark", {}).values())

    def task(self, name: str, host: str | None = None) -> list[TaskResult]:
        """Results of the task called ``name`` (one per host, or per loop item)."""
        return [r for r in self.results if r.task == name and (host is None or r.host == host)]

    def changed_tasks(self) -> list[str]:
        return [f"{r.host}: {r.task}" for r in self.results if r.changed]

    def explain(self) -> str:
        """What to print when an assertion on this run fails."""
        return f"rc={self.rc} status={self.status} changed={self.changed_tasks()}\n{self.stdout[-6000:]}"


_EVENTS = {
    "runner_on_ok": "ok",
    "runner_on_failed": "failed",
    "runner_on_skipped": "skipped",
    "runner_on_unreachable": "unreachable",
    "runner_item_on_ok": "ok",
    "runner_item_on_failed": "failed",
    "runner_item_on_skipped": "skipped",
}


def run_playbook(
    playbook: str | Path,
    tmp_path: Path,
    *,
    inventory: str | Path = LOCAL_INVENTORY,
    extravars: dict[str, Any] | None = None,
    check: bool = False,
    diff: bool = False,
    limit: str | None = None,
    tags: str | None = None,
    env: dict[str, str] | None = None,
) -> PlayResult:
    """Run ``playbook`` once; a loop's items come back one TaskResult each
    (the loop's summary result is left out so each item counts once)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    private = tmp_path / f"runner-{len(list(tmp_path.glob('runner-*')))}"
    private.mkdir()
    cmdline = []
    if check:
        cmdline.append("--check")
    if diff:
        cmdline.append("--diff")
    if isinstance(inventory, str) and not Path(inventory).exists():
        inv_file = private / "inventory" / "hosts"
        inv_file.parent.mkdir()
        inv_file.write_text(inventory)
        inventory = inv_file
    envvars = {
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
        **(env or {}),
    }
    runner = ansible_runner.run(
        private_data_dir=str(private),
        playbook=str(playbook),
        inventory=str(inventory),
        extravars=extravars or {},
        cmdline=" ".join(cmdline) or None,
        limit=limit,
        tags=tags,
        envvars=envvars,
        quiet=True,
        project_dir=str(REPO),
    )
    results: list[TaskResult] = []
    for event in runner.events:
        status = _EVENTS.get(event.get("event", ""))
        if status is None:
            continue
        data = event["event_data"]
        res = data.get("res", {})
        results.append(TaskResult(data.get("host", ""), data.get("task", ""), status, res, res.get("item")))
    # Drop a loop's summary result: its items were recorded one by one.
    results = [
        r
        for r in results
        if not (r.item is None and isinstance(r.res.get("results"), list) and r.res.get("results"))
    ]
    stdout = runner.stdout.read() if runner.stdout else ""
    return PlayResult(rc=runner.rc, status=runner.status, stats=runner.stats or {}, results=results, stdout=stdout)


def four_runs(playbook: str | Path, tmp_path: Path, **kwargs: Any) -> list[PlayResult]:
    """check, apply, check, apply: the idempotence drill every module case goes through."""
    return [
        run_playbook(playbook, tmp_path, check=check, diff=True, **kwargs)
        for check in (True, False, True, False)
    ]


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str)


PLUGINS = REPO / "collections" / "ansible_collections" / "llmgw" / "fleet" / "plugins"


def load_plugin(path):
    """A plugin file of the collection, imported by path as Ansible loads it.

    Its own imports of the collection's module_utils resolve as under
    Ansible's collection loader: through ``ansible_collections`` on the path.
    """
    if str(REPO / "collections") not in sys.path:
        sys.path.append(str(REPO / "collections"))
    spec = importlib.util.spec_from_file_location(f"_llmgw_fleet_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
