"""Placement of prefill and decode replicas: one node, or nodes on one validated fabric; UCX told which ports."""

from __future__ import annotations

from dataclasses import replace

from placement_builders import cap, good_fabric, inventory, nvswitch_h100, request

from llmgw.placement.roles import UCX_NET_DEVICES, place_role, ucx_net_devices


def verdicts(result):
    return {v.node_id: v for v in result.verdicts}


def test_first_of_a_pair_goes_anywhere_and_names_its_fabric_ports():
    nodes = [cap(nvswitch_h100("gpu-a", (good_fabric("ib-a"),)))]
    r = place_role(request(tp=1), nodes, "prefill", "decode", ())
    shard = r.placement.shards[0]
    assert shard.env == {UCX_NET_DEVICES: "mlx5_0:1,mlx5_1:1"}
    assert r.placement.detail.startswith("prefill: ")
    assert "first of its pair" in r.placement.detail
    assert verdicts(r)["gpu-a"].reason.startswith("prefill: chosen")


def test_the_other_group_follows_onto_a_shared_fabric_only():
    nodes = [cap(nvswitch_h100("gpu-a", (good_fabric("ib-a"),)), free=()),  # the prefill group filled it
             cap(nvswitch_h100("gpu-b", (good_fabric("ib-b", ("mlx5_2",)),))),
             cap(nvswitch_h100("gpu-c", (good_fabric("ib-a", ("mlx5_4",)),)))]
    r = place_role(request(tp=4), nodes, "decode", "prefill", {"gpu-a"})
    assert r.placement.nodes == ("gpu-c",)
    assert r.placement.shards[0].env == {UCX_NET_DEVICES: "mlx5_4:1"}
    assert "over fabric ib-a via mlx5_4:1" in r.placement.detail
    v = verdicts(r)
    assert not v["gpu-b"].ok and "no path to the prefill replicas on gpu-a" in v["gpu-b"].reason


def test_without_a_fabric_the_pair_shares_one_node():
    nodes = [cap(nvswitch_h100("gpu-a"), free=range(4, 8)), cap(nvswitch_h100("gpu-b"))]
    r = place_role(request(tp=4), nodes, "decode", "prefill", {"gpu-a"})
    assert r.placement.nodes == ("gpu-a",) and r.placement.shards[0].gpu_indices == (4, 5, 6, 7)
    assert r.placement.shards[0].env == {}  # UCX picks shared memory on its own
    assert "within gpu-a, beside its prefill replicas" in r.placement.detail

    full = [cap(nvswitch_h100("gpu-a"), free=()), cap(nvswitch_h100("gpu-b"))]
    r = place_role(request(tp=4), full, "decode", "prefill", {"gpu-a"})
    assert r.placement is None
    assert r.reason.startswith("decode: ")
    assert "no path to the prefill replicas on gpu-a" in verdicts(r)["gpu-b"].reason


def test_every_peer_node_must_be_reachable():
    a = cap(nvswitch_h100("gpu-a", (good_fabric("ib-a"),)), free=())
    b = cap(nvswitch_h100("gpu-b", (good_fabric("ib-b"),)), free=())
    both = cap(nvswitch_h100("gpu-c", (good_fabric("ib-a"), good_fabric("ib-b", ("mlx5_2",)))))
    only_a = cap(nvswitch_h100("gpu-d", (good_fabric("ib-a"),)))
    r = place_role(request(tp=8), [a, b, both, only_a], "decode", "prefill", {"gpu-a", "gpu-b"})
    assert r.placement.nodes == ("gpu-c",)
    assert r.placement.shards[0].env[UCX_NET_DEVICES] == "mlx5_0:1,mlx5_1:1,mlx5_2:1"
    assert not verdicts(r)["gpu-d"].ok


def test_the_ports_nearest_the_engines_gpus_where_their_places_are_known():
    f = good_fabric("ib-a", ("mlx5_0", "mlx5_1"))
    inv = inventory("gpu-a", 2, fabrics=(f,))
    root0, root1 = "pci0000:00", "pci0000:80"
    gpus = (replace(inv.gpus[0], pci_path=(root0, "0000:00:01.0", "0000:01:00.0", "0000:02:00.0", "0000:03:00.0"),
                    numa_node=0),
            replace(inv.gpus[1], pci_path=(root1, "0000:80:01.0", "0000:81:00.0", "0000:82:00.0", "0000:83:00.0"),
                    numa_node=1))
    hcas = (replace(inv.hcas[0], pci_path=(root0, "0000:00:01.0", "0000:01:00.0", "0000:02:01.0", "0000:04:00.0"),
                    numa_node=0),
            replace(inv.hcas[1], pci_path=(root1, "0000:80:01.0", "0000:81:00.0", "0000:82:01.0", "0000:84:00.0"),
                    numa_node=1))
    inv = replace(inv, gpus=gpus, hcas=hcas)
    assert ucx_net_devices(f, inv, (0,)) == "mlx5_0:1"
    assert ucx_net_devices(f, inv, (1,)) == "mlx5_1:1"
    assert ucx_net_devices(f, inv, (0, 1)) == "mlx5_0:1,mlx5_1:1"
    port_named = replace(f, advertised_hcas=("mlx5_1:2",))
    assert ucx_net_devices(port_named, inv, (0,)) == "mlx5_1:2"  # the only advertised port, far or not


def test_ctl_explain_places_both_groups_in_one_pass_and_says_which_role_went_where():
    from llmgw.catalog import Catalog
    from llmgw.placement import format_result, place_many
    from llmgw.placement.types import PlacementRequest

    cat = Catalog.from_config({
        "models": [{"name": "m", "source": "/models/m"}],
        "profiles": [{"name": "p", "engine": "vllm", "tensor_parallel_size": 4}],
        "deployments": [{"model": "m", "profile": "p", "disaggregation": {
            "connector": "nixl", "prefill": {"replicas": 4, "tensor_parallel_size": 1}, "decode": {"replicas": 1}}}]})
    reqs = [PlacementRequest(model=cat.models["m"], profile=cat.profiles[d.profile])
            for d in cat.deployments for _ in range(d.replicas)]
    nodes = [cap(nvswitch_h100("gpu-a")), cap(nvswitch_h100("gpu-b", (good_fabric("ib-a"),)))]
    results = place_many(reqs, nodes)
    # 4 x TP1 prefill + 1 x TP4 decode on one 8-GPU node: no fabric needed
    assert [r.placement.nodes for r in results] == [("gpu-a",)] * 5
    text = format_result(results[-1], reqs[-1])
    assert "m/p:decode: placed" in text and "decode: " in text and "within gpu-a, beside its prefill replicas" in text
