"""The NVML recorder and its replay (tests/device/nvml_recording.py).

A recording taken on a machine with a GPU is only worth keeping as a fixture
if replaying it makes discovery do exactly what it did on the driver.  These
tests record discovery over the stand-in bindings (and over the real bindings
on this machine, which has no driver), replay, and compare.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from llmgw.hardware.nvml import discover_gpus

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "device"))

from nvml_recording import NotRecorded, RecordingNvml, ReplayNvml, decode, encode  # noqa: E402
from nvml_fake import Dev, FakeNvml, bus, hgx_a100  # noqa: E402


def roundtrip(module) -> tuple[object, object, ReplayNvml]:
    """Discovery over ``module`` recorded, then discovery over the replay."""
    rec = RecordingNvml(module)
    live = discover_gpus(rec)
    doc = json.loads(json.dumps(rec.document(machine="stand-in")))  # as written to and read from a file
    replay = ReplayNvml(doc, pynvml)
    return live, discover_gpus(replay), replay


def test_replay_of_an_nvswitch_board_gives_the_same_discovery():
    live, replayed, replay = roundtrip(FakeNvml(hgx_a100()))
    assert len(live.gpus) == 8 and live.reason is None
    assert replayed == live
    assert "nvmlDeviceGetTopologyCommonAncestor" not in replay.made  # every pair is NVLink


def test_replay_keeps_errors_as_the_bindings_raise_them():
    # A bridged pair, a board that cannot say its tier, a GPU NVML cannot describe.
    devs = [Dev(bus(0x17), links={0: bus(0x65)}), Dev(bus(0x65), links={0: bus(0x17)}),
            Dev(bus(0x81), numa=-1), Dev(bus(0xC1), fail={"nvmlDeviceGetUUID": pynvml.NVML_ERROR_GPU_IS_LOST})]
    fake = FakeNvml(devs, levels={(0, 2): -pynvml.NVML_ERROR_NOT_SUPPORTED})
    live, replayed, _ = roundtrip(fake)
    assert [g.index for g in live.gpus] == [0, 1, 2]
    assert replayed == live
    unknown = [link for link in replayed.topology.links if link.tier is None]
    assert unknown and "NVML_ERROR_NOT_SUPPORTED" in unknown[0].reason


def test_replay_of_old_bindings_keeps_bytes():
    devs = [Dev(bus(0x17), links={0: bus(0x18)}), Dev(bus(0x18), links={0: bus(0x17)})]
    live, replayed, _ = roundtrip(FakeNvml(devs, old_bindings=True))
    assert replayed == live and [g.nvlink_peers for g in replayed.gpus] == [(1,), (0,)]


def test_real_bindings_without_a_driver_replay_the_same_reason():
    live, replayed, _ = roundtrip(pynvml)
    if live.gpus:
        pytest.skip("this machine has an NVIDIA driver; the no-driver answer cannot be recorded here")
    assert replayed.reason == live.reason and replayed.gpus == ()


def test_a_call_the_recording_never_saw_fails_loudly():
    rec = RecordingNvml(FakeNvml([Dev(bus(0x17))]))
    discover_gpus(rec)
    replay = ReplayNvml(json.loads(json.dumps(rec.document())), pynvml)
    replay.nvmlInit()
    with pytest.raises(NotRecorded, match="nvmlDeviceGetHandleByIndex"):
        replay.nvmlDeviceGetHandleByIndex(5)
    with pytest.raises(AttributeError, match="nvmlDeviceGetTotalEccErrors"):
        replay.nvmlDeviceGetTotalEccErrors  # noqa: B018 - the stand-in's bindings had no such function
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # the error itself is replayed by class
        replay.nvmlDeviceGetNvLinkState(replay.nvmlDeviceGetHandleByIndex(0), 0)


def test_ctypes_pointers_become_stable_tokens():
    """Real handles are pointers: the same device is the same token, others differ."""
    handles = [pynvml.c_nvmlDevice_t(pynvml.struct_c_nvmlDevice_t()) for _ in range(2)]
    rec = RecordingNvml(pynvml)
    same = ctypes.cast(ctypes.c_void_p(ctypes.cast(handles[0], ctypes.c_void_p).value), pynvml.c_nvmlDevice_t)
    tokens = [encode(h, rec._handles) for h in (handles[0], handles[1], same)]
    assert tokens[0] == tokens[2] != tokens[1]
    assert tokens[0] == {"$handle": "c_nvmlDevice_t#0"}
    mem = pynvml.c_nvmlMemory_t()
    mem.total = 150_754_820_096
    assert decode(encode(mem)).total == 150_754_820_096


def test_the_capture_script_runs_without_a_driver(tmp_path):
    """The script carried to a GPU machine must at least run where there is none."""
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "device" / "capture_nvml.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    names = {p.name for p in tmp_path.iterdir()}
    assert {"nvml-recording.json", "discovery.json", "health.json", "sysfs.json", "capture.log"} <= names
    assert len(names) <= 8  # what one run on a GPU machine can bring back
    doc = json.loads((tmp_path / "nvml-recording.json").read_text())
    assert doc["about"]["bindings"].startswith("nvidia-ml-py")
    assert len(doc["calls"]) == summary["calls"] > 0
    discovery = json.loads((tmp_path / "discovery.json").read_text())
    assert discovery["gpu_reason"] == summary["gpu_reason"]
