#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llmgw maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: wheelhouse
short_description: Download the runtime's wheels that fit one node interpreter, into a cache
version_added: 0.1.0
description:
  - Runs on the controller. Takes the pinned dependencies of the runtime (O(lock)), keeps those whose
    environment marker holds for O(interpreter), and downloads with C(pip download), binary wheels only and
    no dependencies, the wheel of each that fits that interpreter's CPython version, ABI and manylinux
    platforms (every tag its glibc and architecture run, PEP 600), whatever Python the controller runs.
  - The set lands in a directory of O(cache_dir) named for the interpreter and the pins - the wheels under
    C(wheels/), the same in one archive C(wheels.tar) (one transfer to a node rather than one per wheel),
    and a C(requirements.txt) that pins each package to the sha256 of its wheel, for C(pip install
    --no-index --require-hashes) on the node. The directory appears complete or not at all (it is filled under a
    temporary name and renamed); a later run with the same pins and interpreter finds it and downloads nothing.
  - Fails, naming every package and version without a fitting wheel and the platform, when there is one.
author:
  - llmgw maintainers (!UNKNOWN)
requirements:
  - pip on the controller (in the interpreter running the module)
  - packaging
options:
  lock:
    description:
      - A file of exact pins, C(name==version), one a line, each optionally with an environment marker
        (C(async-timeout==5.0.1; python_version == "3.10")). The project's is C(requirements/runtime.txt).
    type: path
    required: true
  interpreter:
    description:
      - The node's interpreter, as the role's probe reports it.
    type: dict
    required: true
    suboptions:
      version:
        description: Its full version, for example C(3.13.5).
        type: str
        required: true
      implementation:
        description: C(sys.implementation.name); only C(cpython) is supported.
        type: str
        required: true
      abiflags:
        description: C(sys.abiflags), for example an empty string, or C(t) for a free-threaded build.
        type: str
        default: ""
      machine:
        description: C(platform.machine()), for example C(x86_64) or C(aarch64).
        type: str
        required: true
      libc:
        description: C(os.confstr("CS_GNU_LIBC_VERSION")), for example C(glibc 2.41); empty where that is not glibc.
        type: str
        required: true
  cache_dir:
    description: Where the sets are kept, one directory each. Created if missing.
    type: path
    required: true
  python:
    description:
      - The interpreter whose pip downloads (C(python -m pip)); by default the one running this module.
      - The llmgw role passes C(ansible_playbook_python), whose pip builds llmgw's own wheel.
    type: path
  pip_args:
    description:
      - More C(pip download) arguments, for example an internal mirror (C([--index-url, https://pypi.example/simple]))
        or, with no network at all, C([--no-index, --find-links, /srv/wheels]).
    type: list
    elements: str
    default: []
attributes:
  check_mode:
    support: full
    description:
      - Downloads in check mode too - it writes only in O(cache_dir) on the controller, and a check of the
        nodes needs the set to compare their copy with.
  diff_mode:
    support: none
    description: The set's requirements.txt lists what changed.
  platform:
    support: full
    platforms: posix
    description: The controller.
"""

EXAMPLES = r"""
- name: Wheels for a Debian 13 node
  llmgw.fleet.wheelhouse:
    lock: "{{ llmgw_source_dir }}/requirements/runtime.txt"
    cache_dir: ~/.cache/llmgw/wheelhouse
    interpreter: {version: 3.13.5, implementation: cpython, abiflags: "", machine: x86_64, libc: glibc 2.41}
  delegate_to: localhost
  register: wheels
"""

RETURN = r"""
directory:
  description: The set's directory in O(cache_dir) (C(wheels/), C(wheels.tar) and C(requirements.txt)).
  returned: success
  type: str
  sample: /root/.cache/llmgw/wheelhouse/cp313-manylinux_2_41_x86_64-3f2a91c0d4e7
key:
  description: The set's directory name - the ABI, the most specific platform and a digest of the pins and tags.
  returned: always
  type: str
  sample: cp313-manylinux_2_41_x86_64-3f2a91c0d4e7
platform:
  description: The node's most specific platform tag.
  returned: always
  type: str
  sample: manylinux_2_41_x86_64
requirements:
  description: The pins the node installs, C(name==version).
  returned: always
  type: list
  elements: str
  sample: [aiohttp==3.14.5, uvloop==0.23.0]
wheels:
  description: The wheel files of the set.
  returned: success
  type: list
  elements: str
  sample: [uvloop-0.23.0-cp313-cp313-manylinux_2_17_x86_64.manylinux2014_x86_64.whl]
missing:
  description: Each pin with no fitting wheel, with the platform looked for.
  returned: failure
  type: list
  elements: dict
  sample: [{name: uvloop, version: 0.23.0, abi: cp314, platform: manylinux_2_41_x86_64}]
"""

import hashlib
import os
import shutil
import sys
import tarfile
import tempfile
import traceback

from ansible.module_utils.basic import AnsibleModule, missing_required_lib
from ansible_collections.llmgw.fleet.plugins.module_utils.wheelhouse import (
    InterpreterError,
    canonical,
    failed_requirement,
    interpreter_from_probe,
    marker_environment,
    missing_message,
    parse_lock,
    platform_tags,
    select,
    set_key,
    wheel_project,
)

try:
    from packaging.markers import Marker
except ImportError:
    PACKAGING_IMPORT_ERROR = traceback.format_exc()
else:
    PACKAGING_IMPORT_ERROR = None


def _evaluate(marker, environment):
    return Marker(marker).evaluate(environment)


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def archive(wheels, dest):
    """The wheels in one uncompressed tar (they are zip files already), the same bytes for the same wheels."""
    with tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(os.listdir(wheels)):
            info = tar.gettarinfo(os.path.join(wheels, name), arcname=name)
            info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = 0, 0, 0, "", "", 0o644
            with open(os.path.join(wheels, name), "rb") as f:
                tar.addfile(info, f)


def download(module, interpreter, pins, dest):
    """Download each pin's wheel into ``dest``; returns the pins pip found nothing for.

    pip stops at the first pin it cannot satisfy, so that pin is set aside and
    the rest retried (what is already downloaded is not fetched again) until
    every pin is either downloaded or known missing: the operator learns of all
    of them at once.
    """
    base = [module.params["python"] or sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
            "--only-binary=:all:", "--python-version", interpreter.short_version, "--implementation", "cp",
            "--abi", interpreter.abi, "--dest", dest]
    for tag in platform_tags(interpreter):
        base += ["--platform", tag]
    base += module.params["pip_args"]
    todo, missing = list(pins), []
    while todo:
        rc, out, err = module.run_command(base + ["%s==%s" % p for p in todo])
        if rc == 0:
            return missing
        failed = failed_requirement(err + out)
        names = [canonical(failed.split("==")[0])] if failed else []
        gone = [p for p in todo if canonical(p[0]) in names]
        if not gone:
            module.fail_json(msg="pip download failed for %s: %s" % (interpreter.describe(), (err or out).strip()[-2000:]),
                             cmd=" ".join(base), requirements=["%s==%s" % p for p in pins])
        missing += gone
        todo = [p for p in todo if p not in gone]
    return missing


def main():
    module = AnsibleModule(
        argument_spec=dict(
            lock=dict(type="path", required=True),
            interpreter=dict(type="dict", required=True, options=dict(
                version=dict(type="str", required=True),
                implementation=dict(type="str", required=True),
                abiflags=dict(type="str", default=""),
                machine=dict(type="str", required=True),
                libc=dict(type="str", required=True),
            )),
            cache_dir=dict(type="path", required=True),
            python=dict(type="path"),
            pip_args=dict(type="list", elements="str", default=[]),
        ),
        supports_check_mode=True,
    )
    if PACKAGING_IMPORT_ERROR:
        module.fail_json(msg=missing_required_lib("packaging"), exception=PACKAGING_IMPORT_ERROR)
    lock = module.params["lock"]
    try:
        interpreter = interpreter_from_probe(module.params["interpreter"])
        with open(lock) as f:
            pins = select(parse_lock(f.read()), marker_environment(interpreter), _evaluate)
    except InterpreterError as exc:
        module.fail_json(msg=str(exc))
    except (OSError, ValueError) as exc:
        module.fail_json(msg="%s: %s" % (lock, exc))
    key = set_key(pins, interpreter)
    result = dict(changed=False, key=key, platform=interpreter.platform,
                  requirements=["%s==%s" % p for p in pins])
    cache = module.params["cache_dir"]
    final = os.path.join(cache, key)
    if not os.path.isfile(os.path.join(final, "requirements.txt")):
        os.makedirs(cache, exist_ok=True)
        if os.path.isdir(final):  # left incomplete by hand: a set is all there or not there
            shutil.rmtree(final)
        work = tempfile.mkdtemp(prefix=".partial-%s-" % key, dir=cache)
        try:
            wheels = os.path.join(work, "wheels")
            os.mkdir(wheels)
            missing = download(module, interpreter, pins, wheels)
            if missing:
                module.fail_json(
                    msg="%s (pinned in %s)" % (missing_message(missing, interpreter), lock),
                    missing=[dict(name=n, version=v, abi=interpreter.abi, platform=interpreter.platform) for n, v in missing],
                    **result)
            by_project = dict((wheel_project(f), f) for f in os.listdir(wheels))
            lines = []
            for name, version in pins:
                filename = by_project.get(canonical(name))
                if filename is None:  # pip said it succeeded; the file must be there
                    module.fail_json(msg="pip reported %s==%s downloaded, but no wheel of it is in %s" % (name, version, wheels))
                lines.append("%s==%s --hash=sha256:%s\n" % (name, version, _sha256(os.path.join(wheels, filename))))
            archive(wheels, os.path.join(work, "wheels.tar"))
            with open(os.path.join(work, "requirements.txt"), "w") as f:
                f.writelines(lines)
            os.chmod(work, 0o755)
            try:
                os.rename(work, final)
            except OSError:  # another run completed the same set meanwhile
                if not os.path.isfile(os.path.join(final, "requirements.txt")):
                    raise
            else:
                work = None
                result["changed"] = True
        finally:
            if work:
                shutil.rmtree(work, ignore_errors=True)
    result.update(directory=final, wheels=sorted(os.listdir(os.path.join(final, "wheels"))))
    module.exit_json(**result)


if __name__ == "__main__":
    main()
