from pathlib import Path

from llmgw.schemas_doc import render_reference

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_reference_matches_the_schemas():
    assert DOC.read_text() == render_reference(), (
        "docs/configuration.md is stale: run `python -m llmgw.schemas_doc > docs/configuration.md`")


def test_reference_names_every_top_level_server_key():
    text = render_reference()
    for key in ("`api`", "`api.listen.port`", "`lifecycle.unreachable_after`", "`profiles[].engine`",
                "`deployments[].replicas`", "`fabrics[].hcas`"):
        assert key in text
