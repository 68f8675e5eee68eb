"""CI's short profile of the main job: `kvcert certify kvcert.gpu:factory` on every cell it declares.

The default budget's figures (and the page-first and threaded engines') are in README.md and
docs/gpu.md; this run keeps every cell in CI at a fraction of the cost.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvcert.conformance.certification.certify import certify


def test_gpu_is_certified_on_every_cell(tmp_path: Path) -> None:
    cert = certify("kvcert.gpu:factory", examples=12, steps=30, seed=0, out_dir=tmp_path)
    failures = [
        f"P={c.page_size} {c.policy} {c.write_policy or 'device'}: {c.failure}" for c in cert.cells if not c.passed
    ]
    assert not failures, "\n".join(failures)
    assert len(cert.cells) == 77 and cert.strict_input
    assert {c.write_policy.split("+")[0] for c in cert.cells} == {
        "",
        "write_through",
        "write_through_selective",
        "write_back",
    }
    assert all(c.steps > 0 for c in cert.cells)


def test_gpu_metadata_is_compared_under_the_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kvcert.gpu reports its policy metadata (`reports_metadata`): a split that drops the head's hit count is seen
    at the split under the profile that pins RANK (INV-META-1); the core leaves metadata to the backend."""
    from kvcert.gpu.tree import RadixTree

    split = RadixTree.split

    def loses_hits(self: RadixTree, child: Any, cut: int) -> Any:
        head = split(self, child, cut)
        head.hit_count = 0
        return head

    monkeypatch.setattr(RadixTree, "split", loses_hits)
    kw: dict[str, Any] = dict(
        examples=40, steps=30, page_sizes=[1], policies=["lfu"], device_cells=True, out_dir=tmp_path
    )
    cert = certify("kvcert.gpu:factory", write_policies=[], **kw)
    failing = [c for c in cert.cells if not c.passed]
    assert failing and "INV-META-1" in (failing[0].failure or ""), [c.failure for c in cert.cells]
    assert certify("kvcert.gpu:factory", write_policies=[], profile="core", **kw).passed
