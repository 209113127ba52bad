"""Atomic, permission-exact writes of keys and certificates."""

import os
import stat

import pytest

from llmgw.tls.files import pair_paths, private_mode_problem, write_atomic, write_pair, write_private, write_public


def mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_private_file_is_0600_even_with_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        p = write_private(tmp_path / "k.key", b"secret")
    finally:
        os.umask(old)
    assert mode(p) == 0o600
    assert p.read_bytes() == b"secret"


def test_public_file_is_0644_despite_restrictive_umask(tmp_path):
    old = os.umask(0o077)
    try:
        p = write_public(tmp_path / "c.crt", b"cert")
    finally:
        os.umask(old)
    assert mode(p) == 0o644


def test_overwrite_replaces_and_leaves_no_temporaries(tmp_path):
    target = tmp_path / "k.key"
    write_private(target, b"one")
    write_private(target, b"two")
    assert target.read_bytes() == b"two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.key"]


def test_no_overwrite_refuses_and_keeps_original(tmp_path):
    target = tmp_path / "k.key"
    write_private(target, b"original")
    with pytest.raises(FileExistsError):
        write_atomic(target, b"new", mode=0o600, overwrite=False)
    assert target.read_bytes() == b"original"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.key"]


def test_overwrite_tightens_mode_of_a_previously_loose_key(tmp_path):
    target = tmp_path / "k.key"
    target.write_bytes(b"old")
    os.chmod(target, 0o644)
    write_private(target, b"new")
    assert mode(target) == 0o600


def test_write_pair_layout_and_modes(tmp_path):
    crt, key = write_pair(tmp_path / "sub" / "node-gpu-a1", b"CERT", b"KEY")
    assert (crt.name, key.name) == ("node-gpu-a1.crt", "node-gpu-a1.key")
    assert (mode(crt), mode(key)) == (0o644, 0o600)
    assert crt.read_bytes() == b"CERT" and key.read_bytes() == b"KEY"
    assert pair_paths(tmp_path / "a.b") == (tmp_path / "a.b.crt", tmp_path / "a.b.key")


def test_private_mode_problem_names_the_file_and_fix(tmp_path):
    p = tmp_path / "ca.key"
    p.write_bytes(b"x")
    os.chmod(p, 0o640)
    problem = private_mode_problem(p)
    assert problem is not None and str(p) in problem and "0640" in problem and "chmod 600" in problem
    os.chmod(p, 0o600)
    assert private_mode_problem(p) is None
