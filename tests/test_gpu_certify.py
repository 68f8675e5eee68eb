"""CI's short profile of the main job: `kvcert certify kvcert.gpu:factory` on every cell it declares.

The default budget's figures (and the page-first and threaded engines') are in README.md and
docs/gpu.md; this run keeps every cell in CI at a fraction of the cost.
"""

from __future__ import annotations

from pathlib import Path

from kvcert.conformance.certify import certify


def test_gpu_is_certified_on_every_cell(tmp_path: Path) -> None:
    cert = certify("kvcert.gpu:factory", examples=12, steps=30, seed=0, out_dir=tmp_path)
    failures = [
        f"P={c.page_size} {c.policy} {c.write_policy or 'device'}: {c.failure}" for c in cert.cells if not c.passed
    ]
    assert not failures, "\n".join(failures)
    assert len(cert.cells) == 67 and cert.strict_input
    assert {c.write_policy.split("+")[0] for c in cert.cells} == {
        "",
        "write_through",
        "write_through_selective",
        "write_back",
    }
    assert all(c.steps > 0 for c in cert.cells)
