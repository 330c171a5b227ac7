"""The committed field reference is what ``kvpool crd --reference`` generates."""

from __future__ import annotations

from pathlib import Path

from kvpool_cli import main
from kvpool_operator.reference_doc import reference_markdown

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "kvcachepool-reference.md"


def test_committed_reference_matches_the_generator() -> None:
    assert DOC.read_text() == reference_markdown(), (
        "docs/kvcachepool-reference.md is stale: run "
        "`kvpool crd --reference --output docs/kvcachepool-reference.md`"
    )


def test_reference_lists_every_spec_field_with_its_default() -> None:
    text = reference_markdown()
    assert "| `spec.kvCacheConfig.tokensPerBlock` | integer | `32` |" in text
    assert "| `spec.kvCacheConfig.secondaryOffloadMinPriority` | integer | `35` |" in text
    assert "`spec.autoscaling.minReplicas`" in text and "`status.conditions[].type`" in text


def test_check_flag_detects_a_stale_reference(tmp_path: Path) -> None:
    stale = tmp_path / "ref.md"
    stale.write_text("old\n")
    assert main(["crd", "--reference", "--output", str(stale), "--check"]) == 1
    assert main(["crd", "--reference", "--output", str(stale)]) == 0
    assert main(["crd", "--reference", "--output", str(stale), "--check"]) == 0
