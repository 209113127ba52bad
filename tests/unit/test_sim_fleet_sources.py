"""The simulated agents' source addresses: one loopback address per agent (or per N), only where
the control plane is on an IPv4 loopback literal that such an address can dial."""

from __future__ import annotations

from llmgw.sim.fleet.worker import loopback_v4, source_address


def test_each_node_gets_its_own_address_and_n_share_one_when_asked():
    assert [source_address(n, 1) for n in (0, 1, 255, 256, 65536)] == \
        ["127.1.0.0", "127.1.0.1", "127.1.0.255", "127.1.1.0", "127.2.0.0"]
    assert {source_address(n, 4) for n in range(8)} == {"127.1.0.0", "127.1.0.1"}


def test_only_ipv4_loopback_literals_are_dialled_from_loopback_addresses():
    assert loopback_v4("wss://127.0.0.1:8443/v1/agent/stream")
    assert loopback_v4(["wss://127.0.0.1:1/x", "wss://127.0.0.2:2/x"])
    assert not loopback_v4(["wss://127.0.0.1:1/x", "wss://10.0.0.1:2/x"])
    assert not loopback_v4("wss://localhost:8443/v1/agent/stream")  # may be ::1
    assert not loopback_v4("wss://[::1]:8443/v1/agent/stream")
    assert not loopback_v4("wss://cp.example:8443/v1/agent/stream")
