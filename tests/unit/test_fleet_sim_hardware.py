"""The simulator's hardware: templates, the mix, per-node identities, all valid ``hardware`` documents."""

from __future__ import annotations

from collections import Counter

import pytest

from llmgw.config import schema_errors
from llmgw.hardware.simulated import document_errors
from llmgw.sim.fleet.hardware import (DEFAULT_MIX, MixError, MixPart, allocate, builtin_templates, gpu_uuid,
                                      load_templates, node_document, node_inventory, parse_mix, pci_bus_id)


@pytest.fixture(scope="module")
def templates():
    return load_templates()


def test_builtin_templates_cover_the_boards_a_fleet_mixes(templates) -> None:
    assert {"hgx-h100-8gpu", "hgx-h100-8gpu-ib-ndr", "hgx-a100-8gpu-ib-hdr", "pcie-8gpu-nvlink-pairs",
            "pcie-4gpu-nvlink-pairs"} <= set(templates)
    rates = {f["name"]: f["rate_gbps"] for t in templates.values() for f in t.get("fabrics", ())}
    assert rates == {"ib-ndr": 400.0, "ib-hdr": 200.0}  # two fabrics, mixed rates
    pairs = templates["pcie-8gpu-nvlink-pairs"]["gpus"]
    assert [g["nvlink_peers"] for g in pairs] == [[1], [0], [3], [2], [5], [4], [7], [6]]


@pytest.mark.parametrize("name", sorted(builtin_templates()))
def test_every_node_built_from_a_template_is_a_valid_hardware_document(templates, name) -> None:
    for number in (0, 1, 65535, 65536, 99999):
        doc = node_document(templates[name], f"sim-{number:05d}", number)
        assert document_errors(doc) == []
        assert schema_errors(node_inventory(templates[name], f"sim-{number:05d}", number).to_dict(), "hardware") == []


def test_identities_are_per_node_unique_and_stable(templates) -> None:
    t = templates["hgx-h100-8gpu"]
    docs = [node_document(t, f"sim-{n:05d}", n) for n in range(300)]
    uuids = [g["uuid"] for d in docs for g in d["gpus"]]
    buses = [g["pci_bus_id"] for d in docs for g in d["gpus"]]
    assert len(set(uuids)) == len(uuids) == 300 * 8
    assert len(set(buses)) == len(buses)
    assert node_document(t, "sim-00007", 7) == docs[7]  # a rerun reports the same fleet
    assert docs[7]["node_id"] == "sim-00007" and docs[7]["gpu_source"] == "simulated"
    assert t["gpus"][0]["uuid"] not in uuids  # the template's own ids are never reused


def test_pci_bus_id_keeps_the_board_layout_in_the_nodes_domain() -> None:
    assert pci_bus_id("00000000:18:00.0", 0) == "00000000:18:00.0"
    assert pci_bus_id("00000000:18:00.0", 0x12) == "00000012:18:00.0"
    assert pci_bus_id("00000000:DB:00.0", 0x10001) == "00000001:DB:00.0"
    assert gpu_uuid("a", 0) != gpu_uuid("a", 1) != gpu_uuid("b", 1)
    assert gpu_uuid("a", 0).startswith("GPU-")


def test_mix_parses_weights_and_allocates_by_largest_remainder(templates) -> None:
    mix = parse_mix(DEFAULT_MIX, list(templates))
    assert [p.template for p in mix][0] == "hgx-h100-8gpu"
    out = allocate(mix, 1000)
    assert Counter(out) == {"hgx-h100-8gpu": 500, "hgx-h100-8gpu-ib-ndr": 200, "hgx-a100-8gpu-ib-hdr": 200,
                            "pcie-8gpu-nvlink-pairs": 100}
    assert len(allocate(mix, 7)) == 7
    thirds = allocate((MixPart("a", 1), MixPart("b", 1), MixPart("c", 1)), 10)
    assert sorted(Counter(thirds).values()) == [3, 3, 4]
    assert parse_mix("hgx-h100-8gpu", list(templates)) == (MixPart("hgx-h100-8gpu", 1.0),)
    assert Counter(allocate(parse_mix("hgx-h100-8gpu=0,pcie-4gpu-nvlink-pairs=2", list(templates)), 5)) == \
        {"pcie-4gpu-nvlink-pairs": 5}


@pytest.mark.parametrize("text,why", [
    ("nope=1", "unknown template 'nope'"),
    ("hgx-h100-8gpu=x", "not a number"),
    ("hgx-h100-8gpu=-1", ">= 0"),
    ("hgx-h100-8gpu=inf", "finite"),
    ("hgx-h100-8gpu=0", "at least one weight"),
    ("hgx-h100-8gpu=1,hgx-h100-8gpu=2", "given twice"),
    ("hgx-h100-8gpu=1,,", "empty entry"),
])
def test_bad_mix_says_which_part(templates, text, why) -> None:
    with pytest.raises(MixError, match=why):
        parse_mix(text, list(templates))


def test_extra_template_from_a_file_is_validated(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("node_id: x\ngpu_source: simulated\ngpus:\n- {index: 0}\n")
    from llmgw.config import ConfigInvalid

    with pytest.raises(ConfigInvalid, match="/gpus/0"):
        load_templates({"bad": bad})
