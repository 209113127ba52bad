"""Record what a real NVML answers, and replay it where there is no GPU.

NVML can only be faked at the boundary, and a fake written from the headers
says what we *think* the driver answers.  A recording says what it did: every
call llmgw made through the bindings on a machine with a GPU, with its
arguments, its result (structures field by field, strings as str or bytes as
the bindings returned them) or its NVML error code.  ``ReplayNvml`` serves
that recording with the same function names, the bindings' own constants and
exception classes, so discovery runs over it exactly as it ran on the driver.

The format is plain JSON, so a recording from a new board can be read and
reviewed before it becomes a fixture.  A call the recording does not hold
fails loudly (``NotRecorded``): a replay never invents an answer.
"""

from __future__ import annotations

import ctypes
import json
from collections import defaultdict
from typing import Any

FORMAT = 1


class ReplayHandle:
    """A device or event-set handle from a recording: only its token survives."""

    __slots__ = ("token",)

    def __init__(self, token: str) -> None:
        self.token = token

    def __repr__(self) -> str:
        return f"ReplayHandle({self.token!r})"


class ReplayStruct:
    """A structure from a recording: its fields as attributes."""

    def __init__(self, type_name: str, fields: dict[str, Any]) -> None:
        self._type_name = type_name
        for name, value in fields.items():
            setattr(self, name, value)

    def __repr__(self) -> str:
        fields = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return f"{self._type_name}({fields})"


class NotRecorded(AssertionError):
    """The code under test made a call the recording never saw."""


class _Handles:
    """Stable tokens for the opaque pointers the bindings hand out."""

    def __init__(self) -> None:
        self._tokens: dict[tuple[str, int], str] = {}
        self._counts: dict[str, int] = defaultdict(int)

    def token(self, pointer: Any) -> str:
        kind = type(pointer)._type_.__name__.removeprefix("struct_")
        address = ctypes.cast(pointer, ctypes.c_void_p).value or 0
        key = (kind, address)
        if key not in self._tokens:
            self._tokens[key] = f"{kind}#{self._counts[kind]}"
            self._counts[kind] += 1
        return self._tokens[key]


def encode(value: Any, handles: _Handles | None = None) -> Any:
    """A JSON-able form of what the bindings returned or were given."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, ReplayHandle):
        return {"$handle": value.token}
    if isinstance(value, ReplayStruct):
        return {"$struct": value._type_name,
                "fields": {k: encode(v, handles) for k, v in vars(value).items() if not k.startswith("_")}}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": bytes(value).decode("latin-1")}
    if isinstance(value, ctypes._Pointer):  # type: ignore[attr-defined]
        return {"$handle": (handles or _Handles()).token(value)}
    if isinstance(value, ctypes.Structure):
        return {"$struct": type(value).__name__,
                "fields": {name: encode(getattr(value, name), handles) for name, *_ in value._fields_}}
    if isinstance(value, ctypes.Array):
        return {"$array": [encode(v, handles) for v in value]}
    if isinstance(value, ctypes._SimpleCData):  # type: ignore[attr-defined]
        return encode(value.value, handles)
    if isinstance(value, (list, tuple)):
        return {"$list": [encode(v, handles) for v in value]}
    if isinstance(value, dict):
        return {"$dict": {str(k): encode(v, handles) for k, v in value.items()}}
    if hasattr(value, "__dict__"):  # a stand-in's handle or namespace: its fields identify it
        return {"$struct": type(value).__name__,
                "fields": {k: encode(v, handles) for k, v in vars(value).items() if not k.startswith("_")}}
    return {"$repr": repr(value)}


def decode(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    if "$handle" in value:
        return ReplayHandle(value["$handle"])
    if "$bytes" in value:
        return value["$bytes"].encode("latin-1")
    if "$struct" in value:
        return ReplayStruct(value["$struct"], {k: decode(v) for k, v in value["fields"].items()})
    if "$array" in value:
        return [decode(v) for v in value["$array"]]
    if "$list" in value:
        return [decode(v) for v in value["$list"]]
    if "$dict" in value:
        return {k: decode(v) for k, v in value["$dict"].items()}
    raise ValueError(f"cannot replay {value!r}")


class RecordingNvml:
    """The bindings module, with every ``nvml*`` call written down."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self._handles = _Handles()
        self.calls: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._module, name)
        if not (name.startswith("nvml") and callable(attr)):
            return attr

        def call(*args: Any) -> Any:
            entry: dict[str, Any] = {"fn": name, "args": encode(list(args), self._handles)}
            try:
                result = attr(*args)
            except self._module.NVMLError as e:
                entry.update(error=int(e.value), text=str(e))
                self.calls.append(entry)
                raise
            except Exception as e:
                entry.update(exception=type(e).__name__, text=str(e))
                self.calls.append(entry)
                raise
            entry["result"] = encode(result, self._handles)
            self.calls.append(entry)
            return result

        return call

    def document(self, **about: Any) -> dict[str, Any]:
        """The recording, with the bindings' function names and constants."""
        module = self._module
        return {
            "format": FORMAT,
            "about": about,
            "functions": sorted(n for n in dir(module) if n.startswith("nvml") and callable(getattr(module, n))),
            "constants": {n: getattr(module, n) for n in dir(module)
                          if n.startswith(("NVML_", "nvmlEventType", "nvmlClocksEvent"))
                          and isinstance(getattr(module, n), int) and not isinstance(getattr(module, n), bool)},
            "calls": self.calls,
        }


class ReplayNvml:
    """A bindings-shaped module that answers from a recording.

    Functions are those the recorded bindings had (a newer local binding's
    extra functions are absent, as on that machine); constants are the
    recorded ones; exception classes are the local bindings', raised as
    ``bindings.NVMLError(code)`` exactly as the real wrapper does.  The same
    call made more times than recorded gets the last answer again.
    """

    def __init__(self, recording: dict[str, Any], bindings: Any) -> None:
        if recording.get("format") != FORMAT:
            raise ValueError(f"recording format {recording.get('format')!r}, expected {FORMAT}")
        self._bindings = bindings
        self._functions = set(recording["functions"])
        self._constants = dict(recording["constants"])
        self._answers: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        self._served: dict[tuple[str, str], int] = defaultdict(int)
        for call in recording["calls"]:
            self._answers[(call["fn"], json.dumps(call["args"], sort_keys=True))].append(call)
        self.made: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._constants:
            return self._constants[name]
        if name.startswith("nvml"):
            if name not in self._functions:
                raise AttributeError(f"the recorded bindings have no {name}")
            return lambda *args: self._answer(name, args)
        return getattr(self._bindings, name)

    def _answer(self, name: str, args: tuple[Any, ...]) -> Any:
        key = (name, json.dumps(encode(list(args)), sort_keys=True))
        answers = self._answers.get(key)
        if not answers:
            raise NotRecorded(f"{name}{tuple(args)!r} was not recorded")
        n = self._served[key]
        self._served[key] = n + 1
        call = answers[min(n, len(answers) - 1)]
        self.made.append(name)
        if "error" in call:
            raise self._bindings.NVMLError(call["error"])
        if "exception" in call:
            raise RuntimeError(f"{call['exception']}: {call['text']}")
        return decode(call["result"])
