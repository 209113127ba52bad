"""The wheels a node gets for its own interpreter (llmgw.fleet.wheelhouse and the
llmgw role's wheelhouse.yml), and the lock they are pinned by.

The module runs real ``pip download`` against a directory of wheels made here
(``--no-index --find-links``: no network), the way an air-gapped controller
runs it against its mirror. A node whose interpreter no pinned wheel fits must
fail through the role, naming the package, version and platform, before its
virtualenv exists. The mixed-interpreter rollout itself (Debian 12 and 13 hosts)
is the molecule ``agent`` scenario.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.markers import Marker

from fleet_harness import PLAYBOOKS, REPO, run_playbook

PLUGINS = REPO / "collections" / "ansible_collections" / "llmgw" / "fleet" / "plugins"


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wh = _load(PLUGINS / "module_utils" / "wheelhouse.py", "_llmgw_fleet_wheelhouse")
lock_runtime = _load(REPO / "requirements" / "lock_runtime.py", "_llmgw_lock_runtime")

TRIXIE = {"version": "3.13.5", "implementation": "cpython", "abiflags": "", "machine": "x86_64", "libc": "glibc 2.41"}
JAMMY = {"version": "3.10.12", "implementation": "cpython", "abiflags": "", "machine": "x86_64", "libc": "glibc 2.35"}
BOOKWORM_ARM = {"version": "3.11.2", "implementation": "cpython", "abiflags": "", "machine": "aarch64", "libc": "glibc 2.36"}


# ---- pure rules --------------------------------------------------------------

def test_platform_tags_are_every_manylinux_the_glibc_runs_newest_first():
    tags = wh.platform_tags(wh.interpreter_from_probe(TRIXIE))
    assert tags[0] == "manylinux_2_41_x86_64"
    assert tags[-2:] == ["manylinux_2_5_x86_64", "manylinux1_x86_64"]
    assert "manylinux2014_x86_64" in tags and "manylinux2010_x86_64" in tags
    arm = wh.platform_tags(wh.interpreter_from_probe(BOOKWORM_ARM))
    assert arm[0] == "manylinux_2_36_aarch64" and arm[-2:] == ["manylinux_2_17_aarch64", "manylinux2014_aarch64"]
    assert not any("2010" in t or "manylinux1" in t for t in arm)


def test_abi_follows_version_and_free_threading():
    assert wh.interpreter_from_probe(TRIXIE).abi == "cp313"
    assert wh.interpreter_from_probe({**TRIXIE, "abiflags": "t"}).abi == "cp313t"


@pytest.mark.parametrize("probe, words", [
    ({**TRIXIE, "libc": ""}, "libc is 'unknown'"),
    ({**TRIXIE, "libc": "musl 1.2"}, "glibc (manylinux) nodes only"),
    ({**TRIXIE, "implementation": "pypy"}, "interpreter/implementation: pypy"),
    ({**TRIXIE, "version": None}, "interpreter/version"),
    ({**TRIXIE, "version": "2.7.18"}, "not a Python 3 version"),
])
def test_probes_that_name_no_wheel_platform_are_refused_by_field(probe, words):
    with pytest.raises(wh.InterpreterError, match=words.replace("(", r"\(").replace(")", r"\)")):
        wh.interpreter_from_probe(probe)


def test_markers_are_judged_for_the_node_not_the_controller():
    pins = wh.parse_lock('a==1\nasync-timeout==5.0.1; python_version == "3.10"\n# comment\n\nb==2  # why\n')
    evaluate = lambda m, env: Marker(m).evaluate(env)  # noqa: E731
    old = wh.select(pins, wh.marker_environment(wh.interpreter_from_probe(JAMMY)), evaluate)
    new = wh.select(pins, wh.marker_environment(wh.interpreter_from_probe(TRIXIE)), evaluate)
    assert old == [("a", "1"), ("async-timeout", "5.0.1"), ("b", "2")]
    assert new == [("a", "1"), ("b", "2")]


def test_a_lock_line_that_is_no_exact_pin_is_refused_with_its_line_number():
    with pytest.raises(ValueError, match="line 2: 'b>=2' is not an exact pin"):
        wh.parse_lock("a==1\nb>=2\n")


def test_the_set_key_changes_with_any_pin_or_platform():
    t = wh.interpreter_from_probe(TRIXIE)
    key = wh.set_key([("a", "1")], t)
    assert key.startswith("cp313-manylinux_2_41_x86_64-")
    assert key != wh.set_key([("a", "2")], t)
    assert key != wh.set_key([("a", "1")], wh.interpreter_from_probe({**TRIXIE, "libc": "glibc 2.36"}))


def test_pips_no_match_message_names_the_requirement():
    out = ("ERROR: Could not find a version that satisfies the requirement uvloop==0.23.0 (from versions: none)\n"
           "ERROR: No matching distribution found for uvloop==0.23.0\n")
    assert wh.failed_requirement(out) == "uvloop==0.23.0"
    assert wh.failed_requirement("ERROR: Could not install packages due to an OSError") is None


# ---- the lock ------------------------------------------------------------------

def test_the_lock_is_made_from_the_current_dependencies():
    lock = (REPO / "requirements" / "runtime.txt").read_text()
    assert lock_runtime.recorded_digest(lock) == lock_runtime.digest(lock_runtime.dependencies()), (
        "pyproject.toml's dependencies changed: remake the lock with requirements/lock_runtime.py")


@pytest.mark.parametrize("python", ["3.10", "3.11", "3.12", "3.13"])
def test_the_lock_pins_every_dependency_within_pyprojects_range(python):
    from packaging.requirements import Requirement

    env = {"python_version": python, "python_full_version": python + ".0", "sys_platform": "linux",
           "platform_machine": "x86_64", "implementation_name": "cpython"}
    pins = {wh.canonical(n): v for n, v, m in wh.parse_lock((REPO / "requirements" / "runtime.txt").read_text())
            if m is None or Marker(m).evaluate(env)}
    for dep in map(Requirement, lock_runtime.dependencies()):
        if dep.marker is not None and not dep.marker.evaluate(env):
            continue
        name = wh.canonical(dep.name)
        assert name in pins, f"{dep.name} is not pinned for Python {python}"
        assert dep.specifier.contains(pins[name], prereleases=True), f"{dep.name}=={pins[name]} is outside {dep.specifier}"


# ---- through Ansible -------------------------------------------------------------

def _wheel(directory, name, version, tag):
    """A minimal, valid wheel (PEP 427) of an empty package."""
    dist = f"{name}-{version}"
    files = {
        f"{name}/__init__.py": b"",
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}.dist-info/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: {tag}\n".encode(),
    }
    record = "".join(
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"
        for path, data in files.items()) + f"{dist}.dist-info/RECORD,,\n"
    path = directory / f"{dist}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name_, data in files.items():
            z.writestr(name_, data)
        z.writestr(f"{dist}.dist-info/RECORD", record)
    return path


@pytest.fixture()
def mirror(tmp_path):
    """A lock of a pure and a binary package, and a directory holding the wheels there are:
    the binary one is built for CPython 3.13 on glibc 2.17+ x86_64 only."""
    wheels = tmp_path / "mirror"
    wheels.mkdir()
    _wheel(wheels, "demo_pure", "1.0", "py3-none-any")
    _wheel(wheels, "demo_native", "2.0", "cp313-cp313-manylinux_2_17_x86_64")
    lock = tmp_path / "runtime.txt"
    lock.write_text('demo-pure==1.0\ndemo-native==2.0\nonly-old==9.9; python_version < "3.11"\n')
    return {"lock": str(lock), "mirror": str(wheels), "cache_dir": str(tmp_path / "cache")}


def _items(run):
    return run.task("Prepare a wheelhouse")


def test_a_set_is_downloaded_once_per_interpreter_and_pinned_by_hash(tmp_path, mirror):
    runs = [run_playbook(PLAYBOOKS / "wheelhouse.yml", tmp_path / "ansible", check=check,
                         extravars={**mirror, "interpreters": [TRIXIE]}) for check in (True, False)]
    first, second = (_items(r)[0] for r in runs)
    assert first.status == "ok" and first.changed, first.res
    assert second.status == "ok" and not second.changed, "the cached set was downloaded again"
    assert first.res["directory"] == second.res["directory"]
    assert first.res["wheels"] == ["demo_native-2.0-cp313-cp313-manylinux_2_17_x86_64.whl", "demo_pure-1.0-py3-none-any.whl"]
    assert first.res["requirements"] == ["demo-pure==1.0", "demo-native==2.0"]  # only-old is for 3.10
    set_dir = Path(first.res["directory"])
    pins = (set_dir / "requirements.txt").read_text().splitlines()
    native = (set_dir / "wheels" / first.res["wheels"][0]).read_bytes()
    assert pins[1] == "demo-native==2.0 --hash=sha256:" + hashlib.sha256(native).hexdigest()
    assert [p.name for p in Path(mirror["cache_dir"]).iterdir()] == [set_dir.name], "a partial set was left"


def test_an_interpreter_no_wheel_fits_fails_naming_every_package_version_and_platform(tmp_path, mirror):
    run = run_playbook(PLAYBOOKS / "wheelhouse.yml", tmp_path / "ansible",
                       extravars={**mirror, "interpreters": [JAMMY]})
    (item,) = _items(run)
    assert item.status == "failed", item.res
    assert item.res["msg"].startswith(
        "no wheel of demo-native 2.0, only-old 9.9 fits CPython 3.10.12 (cp310) on manylinux_2_35_x86_64 (glibc 2.35, x86_64)")
    assert [m["name"] for m in item.res["missing"]] == ["demo-native", "only-old"]
    assert list(Path(mirror["cache_dir"]).iterdir()) == [], "a failed set must leave nothing under a final name"


def test_the_role_fails_a_host_no_wheel_fits_before_touching_it(tmp_path, mirror):
    """This interpreter (the controller's own, not 3.13) has no demo-native wheel."""
    prefix = tmp_path / "host"
    run = run_playbook(PLAYBOOKS / "wheelhouse_install.yml", tmp_path / "ansible",
                       extravars={**mirror, "prefix": str(prefix)})
    assert run.rc != 0, run.explain()
    (failed,) = run.task("Fail a host no pinned wheel fits")
    abi = "cp%d%d" % sys.version_info[:2]
    assert failed.status == "failed"
    assert f"localhost: no wheel of demo-native 2.0 fits CPython {sys.version.split()[0]} ({abi}) on manylinux_2_" \
        in failed.res["msg"], failed.res["msg"]
    assert not (prefix / "opt").exists(), "the host was touched before its wheels were known"
