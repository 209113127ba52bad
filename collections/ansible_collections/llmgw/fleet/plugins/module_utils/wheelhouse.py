# -*- coding: utf-8 -*-
# Copyright: llmgw maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Which wheels fit a node's interpreter: the pure half of llmgw.fleet.wheelhouse.

Nodes install the runtime with no package index, from binary wheels the
controller downloads for them. A wheel fits an interpreter by its tags
(PEP 425): the CPython version and ABI (``cp313``), and the platform, which on
Linux is the oldest glibc the wheel needs (PEP 600: ``manylinux_2_17_x86_64``
runs on glibc 2.17 and newer). pip's ``--platform`` takes those tags literally
and does not expand a glibc version into the older tags it also accepts, so the
whole list is computed here; likewise pip evaluates environment markers for the
interpreter it runs on, so the lock's markers are evaluated here for the node's.
"""

from __future__ import annotations

import hashlib
import re

# Lowest glibc minor version with a manylinux tag on each architecture (PEP 600),
# and the legacy names of some (PEP 513, 571, 599).
_FIRST_MINOR = {"x86_64": 5, "i686": 5}
_LEGACY = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
_LEGACY_ARCHES = {
    "manylinux2014": ("x86_64", "i686", "aarch64", "armv7l", "ppc64", "ppc64le", "s390x"),
    "manylinux2010": ("x86_64", "i686"),
    "manylinux1": ("x86_64", "i686"),
}
_NO_MATCH = re.compile(r"No matching distribution found for (\S+)")


class InterpreterError(ValueError):
    """A probe of a node's interpreter that names no platform wheels are built for."""


class Interpreter(object):
    """What a node's Python is, as far as wheels care."""

    def __init__(self, version, implementation, abiflags, machine, libc):
        self.version = version              # "3.13.5"
        self.implementation = implementation  # "cpython"
        self.abiflags = abiflags            # "" or "t" (free-threaded)
        self.machine = machine              # "x86_64", "aarch64"
        self.libc = libc                    # "glibc 2.41"

    @property
    def short_version(self):
        return ".".join(self.version.split(".")[:2])

    @property
    def abi(self):
        return "cp" + self.short_version.replace(".", "") + self.abiflags

    @property
    def glibc(self):
        """(major, minor) of the node's glibc."""
        return _glibc(self.libc)

    @property
    def platform(self):
        """The node's most specific platform tag, the one messages name."""
        return platform_tags(self)[0]

    def describe(self):
        return "CPython %s (%s) on %s (%s, %s)" % (self.version, self.abi, self.platform, self.libc, self.machine)


def _glibc(libc):
    match = re.match(r"glibc (\d+)\.(\d+)", libc or "")
    if not match:
        raise InterpreterError("libc is %r: wheels are chosen for glibc (manylinux) nodes only" % (libc or "unknown"))
    return int(match.group(1)), int(match.group(2))


def interpreter_from_probe(probe):
    """An Interpreter from the role's probe of a node (a dict), each field checked by name."""
    if not isinstance(probe, dict):
        raise InterpreterError("interpreter: expected the probe's mapping, got %s" % type(probe).__name__)
    fields = {}
    for key in ("version", "implementation", "abiflags", "machine", "libc"):
        value = probe.get(key)
        if not isinstance(value, str) or (not value and key not in ("abiflags", "libc")):
            raise InterpreterError("interpreter/%s: expected a non-empty string, got %r" % (key, value))
        fields[key] = value
    if fields["implementation"] != "cpython":
        raise InterpreterError("interpreter/implementation: %s; wheels are chosen for CPython only"
                               % fields["implementation"])
    if not re.match(r"^3\.\d+(\.\d+)?", fields["version"]):
        raise InterpreterError("interpreter/version: %r is not a Python 3 version" % fields["version"])
    interpreter = Interpreter(**fields)
    interpreter.glibc  # noqa: B018 - fail now, naming the libc, rather than at download
    return interpreter


def platform_tags(interpreter):
    """Every manylinux tag the node's glibc and architecture run, most specific first."""
    major, minor = interpreter.glibc
    arch = interpreter.machine
    tags = []
    for m in range(minor, _FIRST_MINOR.get(arch, 17) - 1, -1):
        tags.append("manylinux_%d_%d_%s" % (major, m, arch))
        legacy = _LEGACY.get(m) if major == 2 else None
        if legacy and arch in _LEGACY_ARCHES[legacy]:
            tags.append("%s_%s" % (legacy, arch))
    if not tags:
        raise InterpreterError("glibc %d.%d on %s is older than any manylinux platform" % (major, minor, arch))
    return tags


def marker_environment(interpreter):
    """The node's values of the environment markers (PEP 508) a lock line may carry."""
    return {
        "implementation_name": "cpython",
        "implementation_version": interpreter.version,
        "os_name": "posix",
        "platform_machine": interpreter.machine,
        "platform_python_implementation": "CPython",
        "platform_release": "",
        "platform_system": "Linux",
        "platform_version": "",
        "python_full_version": interpreter.version,
        "python_version": interpreter.short_version,
        "sys_platform": "linux",
    }


def parse_lock(text):
    """The lock's lines as (name, version, marker text or None); only exact pins are accepted."""
    pins = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        spec, marker = (line.split(";", 1) + [""])[:2]
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s=<>!~,;]+)$", spec.strip())
        if not match:
            raise ValueError("line %d: %r is not an exact pin (name==version)" % (number, raw))
        pins.append((match.group(1), match.group(2), marker.strip() or None))
    return pins


def select(pins, environment, evaluate):
    """The pins whose marker holds for the node; ``evaluate(marker, environment)`` judges one."""
    return [(name, version) for name, version, marker in pins if marker is None or evaluate(marker, environment)]


def set_key(pins, interpreter):
    """A name for the set of wheels one interpreter gets: readable, and changed by any pin."""
    h = hashlib.sha256()
    for part in [interpreter.abi] + platform_tags(interpreter) + ["%s==%s" % p for p in sorted(pins)]:
        h.update(part.encode() + b"\n")
    return "%s-%s-%s" % (interpreter.abi, interpreter.platform, h.hexdigest()[:12])


def canonical(name):
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_project(filename):
    """The project a wheel file is of (PEP 427 file names)."""
    return canonical(filename.split("-", 1)[0])


def failed_requirement(pip_output):
    """The requirement pip found no fitting distribution for, or None when it failed otherwise."""
    match = _NO_MATCH.search(pip_output or "")
    return match.group(1) if match else None


def missing_message(missing, interpreter):
    """What the operator reads: each package and version without a wheel, and the platform."""
    return "no wheel of %s fits %s" % (
        ", ".join("%s %s" % (name, version) for name, version in missing), interpreter.describe())
