import hashlib

import pytest

from llmgw.router.auth import ANONYMOUS, AuthFailure, KeyRing, hash_key
from llmgw.router.settings import ApiKey


def ring(open_=False):
    return KeyRing([ApiKey("alice", hash_key("sk-alice"), frozenset({"m1"})),
                    ApiKey("ops", hash_key("sk-ops"), None)], allow_unauthenticated=open_)


def test_hash_matches_sha256sum_of_the_key_bytes():
    assert hash_key("sk-x") == hashlib.sha256(b"sk-x").hexdigest()


def test_known_keys_map_to_their_principal_and_models():
    r = ring()
    alice = r.authenticate("Bearer sk-alice")
    assert alice.name == "alice" and alice.allows("m1") and not alice.allows("m2")
    ops = r.authenticate("bearer   sk-ops")
    assert ops.allows("anything")


@pytest.mark.parametrize("header,msg", [
    (None, "missing API key"),
    ("", "missing API key"),
    ("Basic abc", "malformed"),
    ("Bearer ", "malformed"),
    ("Bearer sk-wrong", "invalid API key"),
])
def test_rejections_say_why(header, msg):
    with pytest.raises(AuthFailure, match=msg):
        ring().authenticate(header)


def test_open_router_serves_any_caller_for_every_model():
    r = ring(open_=True)
    assert r.authenticate(None) is ANONYMOUS
    assert r.authenticate("Bearer placeholder") is ANONYMOUS  # SDKs always send some key
    assert r.authenticate("Basic x") is ANONYMOUS
    alice = r.authenticate("Bearer sk-alice")
    assert alice.name == "alice" and alice.allows("m2")  # named in the log, not restricted
