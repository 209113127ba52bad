"""A real fleet described twice: as Ansible declares it and as the control plane sees it.

``LiveFleet`` wraps the integration tests' ``Fleet`` (control plane, agents and
engine simulators as separate processes over mutual TLS) and gives each node
what a deployed node has: its certificate in its own TLS directory and a
declared InfiniBand fabric, checked by the agent against a sysfs fixture tree.
It writes the static inventory that declares the fleet and the
``llmgw.fleet.llmgw`` configuration that reads it back, and runs
``ansible-inventory`` and ``playbooks/drift.yml`` over both the way an
operator does.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import yaml

from fleet import WAIT, Fleet, until
from llmgw.tls import issue_node
from llmgw.tls.files import write_pair

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SYSFS = REPO / "tests" / "fixtures" / "sysfs"
FABRICS = [{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_1"], "min_rate_gbps": 200}]

# ansible-* from this virtualenv, the repository's ansible.cfg, and a source the
# plugin cannot parse is an error, not a warning and an empty inventory.
ANSIBLE_ENV = {
    "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
    "ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED": "true",
    "ANSIBLE_NOCOLOR": "1",
    "ANSIBLE_FORCE_COLOR": "0",
    "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
}


def plain(obj: Any) -> Any:
    """ansible-inventory's JSON with its ``{"__ansible_unsafe": "..."}`` markers (strings never templated) unwrapped."""
    if isinstance(obj, dict):
        if len(obj) == 1 and "__ansible_unsafe" in obj:
            return obj["__ansible_unsafe"]
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    return obj


def ansible_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "LLMGW_"))}
    return {**env, **ANSIBLE_ENV, "ANSIBLE_LOCAL_TEMP": str(tmp / "ansible-tmp"), **extra}


def run(argv: list[str], tmp: Path, env: dict[str, str] | None = None, timeout: float = WAIT) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, env={**ansible_env(tmp), **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)


class LiveFleet:
    def __init__(self, root: Path, nodes: dict[str, int], replicas: int, **fleet_kwargs: Any):
        self.root = root
        self.fleet = Fleet(root / "fleet", nodes=nodes, replicas=replicas, **fleet_kwargs)
        self.replicas = replicas
        self.tls: dict[str, Path] = {}
        for name in nodes:
            self.tls[name] = self._node_tls(name)
            self.set_agent(name, fabrics=FABRICS, sysfs="healthy")
        self.plugin_config = self.write_plugin_config()

    # -- nodes ---------------------------------------------------------------
    def node(self, name: str) -> str:
        return self.fleet.node_ids[name]

    def _node_tls(self, name: str) -> Path:
        d = self.root / "tls" / name
        d.mkdir(parents=True)
        crt, key = self.fleet.pki.node(self.node(name))
        shutil.copy(crt, d / "node.crt")
        shutil.copy(key, d / "node.key")
        shutil.copy(self.fleet.pki.ca_cert, d / "ca.crt")
        return d

    def agent_config_path(self, name: str) -> Path:
        return self.fleet.root / name / "agent.yaml"

    def set_agent(self, name: str, *, fabrics: list[dict[str, Any]], sysfs: str) -> None:
        """Render the node's agent.yaml as the agent role would: fabrics and TLS from the declaration."""
        path = self.agent_config_path(name)
        cfg = yaml.safe_load(path.read_text())
        d = self.tls[name]
        cfg["tls"] = {"ca": str(d / "ca.crt"), "cert": str(d / "node.crt"), "key": str(d / "node.key")}
        cfg["fabrics"] = copy.deepcopy(fabrics)
        cfg["discovery"]["sysfs_root"] = str(SYSFS / sysfs / "class" / "infiniband")
        path.write_text(yaml.safe_dump(cfg))
        # A simulated node whose hardware file lists no adapters reads them from sysfs.
        hw_path = Path(cfg["discovery"]["hardware_file"])
        hw = yaml.safe_load(hw_path.read_text())
        for key in ("hcas", "fabrics", "undeclared_hcas"):
            hw.pop(key, None)
        hw_path.write_text(yaml.safe_dump(hw))

    def reissue_cert(self, name: str, days: int) -> None:
        write_pair(self.tls[name] / "node", *issue_node(self.fleet.pki.ca, self.node(name), days))

    def restart_agent(self, name: str, env_prefix: list[str] | None = None) -> None:
        """Restart the agent (engines keep running and are adopted) and wait for its new registration."""
        agent = self.fleet.agents[name]
        node = self.node(name)
        epoch = self.fleet.nodes()[node]["epoch"]
        agent.terminate()
        base = [a for a in agent.argv if a != "env" and not a.startswith("PYTHONPATH=")]
        agent.argv = [*(env_prefix or []), *base]
        agent.start()
        until(lambda: (n := self.fleet.nodes()[node])["connected"] and n["epoch"] > epoch,
              f"{node} to register again", on_timeout=self.fleet.dump)
        self.fleet.wait_ready(self.replicas)

    # -- declarations ----------------------------------------------------------
    def declared(self, **overrides: Any) -> dict[str, Any]:
        """The static inventory of this fleet (as a YAML document), with per-host edits in ``overrides``."""
        hosts: dict[str, Any] = {}
        for name in self.fleet.agents:
            hosts[self.node(name)] = {"llmgw_fabrics": copy.deepcopy(FABRICS), "llmgw_tls_dir": str(self.tls[name])}
        for host, vars_ in overrides.pop("hosts", {}).items():
            if vars_ is None:
                hosts.pop(host, None)
            else:
                hosts.setdefault(host, {}).update(vars_)
        all_vars = {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "llmgw_deployments": [{"model": "tiny", "profile": "sim", "replicas": self.replicas}],
            **overrides,
        }
        return {"all": {"vars": all_vars, "children": {"llmgw_agents": {"hosts": hosts}}}}

    def write_declared(self, doc: dict[str, Any]) -> Path:
        n = len(list(self.root.glob("declared-*")))
        path = self.root / f"declared-{n}" / "hosts.yml"
        path.parent.mkdir()
        path.write_text(yaml.safe_dump(doc))
        return path

    def write_plugin_config(self, name: str = "fleet.llmgw.yml", **options: Any) -> Path:
        pki = self.fleet.pki
        doc = {"plugin": "llmgw.fleet.llmgw", "url": self.fleet.url, "ca_path": str(pki.ca_cert),
               "client_cert": str(pki.admin[0]), "client_key": str(pki.admin[1]), **options}
        path = self.root / name
        path.write_text(yaml.safe_dump(doc))
        return path

    # -- ansible -------------------------------------------------------------------
    def inventory_list(self, *sources: Path) -> dict[str, Any]:
        argv = [str(BIN / "ansible-inventory"), "--list"]
        for s in sources or (self.plugin_config,):
            argv += ["-i", str(s)]
        res = run(argv, self.root)
        assert res.returncode == 0, res.stderr
        return plain(json.loads(res.stdout))

    def drift(self, declared: dict[str, Any] | Path, *extra: str) -> subprocess.CompletedProcess:
        path = declared if isinstance(declared, Path) else self.write_declared(declared)
        argv = [str(BIN / "ansible-playbook"), str(REPO / "playbooks" / "drift.yml"),
                "-i", str(path), "-i", str(self.plugin_config), *extra]
        return run(argv, self.root)


@contextlib.contextmanager
def running(root: Path, nodes: dict[str, int], replicas: int, **fleet_kwargs: Any) -> Iterator[LiveFleet]:
    """A started ``LiveFleet`` with all its replicas Ready, closed on the way out."""
    lf = LiveFleet(root, nodes, replicas=replicas, **fleet_kwargs)
    lf.fleet.start()
    try:
        lf.fleet.wait_ready(replicas)
        yield lf
    finally:
        lf.fleet.close()
