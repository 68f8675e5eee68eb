"""SGLang's UnifiedRadixCache + HiCache certified against SPEC.md §9, per tree core and host layout.

Short runs for CI (the figures of longer ones are in docs/sglang.md): every write policy and the
device-only cells, at page sizes 1 and 4. Skipped as a whole without the `sglang` extra.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _sglang import require_sglang

require_sglang()

from kvcert.conformance.certification.certify import certify  # noqa: E402

pytestmark = pytest.mark.sglang

TARGETS = ["factory", "factory_rust", "factory_page_first", "factory_rust_page_first"]


@pytest.mark.parametrize("name", TARGETS)
def test_hicache_is_certified(name: str, tmp_path: Path) -> None:
    target = f"kvcert.conformance.adapters.sglang.hicache_backend:{name}"
    cert = certify(target, examples=40, steps=30, seed=0, page_sizes=[1, 4], policies=["lru"], out_dir=tmp_path)
    failures = [f"P={c.page_size} {c.write_policy or 'device'}: {c.failure}" for c in cert.cells if not c.passed]
    assert not failures, "\n".join(failures)
    tiers = {(c.page_size, c.write_policy) for c in cert.cells}
    assert tiers == {(p, w) for p in (1, 4) for w in ("", "write_through", "write_through_selective", "write_back")}
    assert all(c.steps > 0 for c in cert.cells)


@pytest.mark.parametrize("name", ["factory", "factory_rust"])
def test_hicache_ranks_slru_and_tlru(name: str, tmp_path: Path) -> None:
    """SLRU and T-LRU (SPEC.md §4.5) on both tree cores, device only and under write-through; under write-back
    neither core counts a hit, so SLRU is LRU there: the logged finding SG-SLRU-WB reproduces before any cell."""
    target = f"kvcert.conformance.adapters.sglang.hicache_backend:{name}"
    cert = certify(
        target,
        examples=20,
        steps=30,
        seed=0,
        page_sizes=[1],
        policies=["slru", "tlru"],
        write_policies=["write_through"],
        out_dir=tmp_path,
    )
    failures = [f"{c.policy} {c.write_policy or 'device'}: {c.failure}" for c in cert.cells if not c.passed]
    assert not failures, "\n".join(failures)
    assert {(c.policy, c.write_policy) for c in cert.cells} == {
        (p, w) for p in ("slru", "tlru") for w in ("", "write_through")
    }
    assert any(f.id == "SG-SLRU-WB" and f.reproduced for f in cert.findings) and not cert.passed
