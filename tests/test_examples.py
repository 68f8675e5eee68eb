"""The adapter kit's example (examples/tinycache): it certifies, and its certificate is not vacuous.

The example lives outside the kvcert package, at the repository root, so the root goes on
`sys.path` here (the CLI needs `PYTHONPATH=.` for the same reason: `load_factory` imports the
target by module name).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.tinycache import adapter  # noqa: E402
from examples.tinycache.cache import InsertResult, MatchResult, RadixCache, TreeNode  # noqa: E402
from kvcert.conformance.backend import Backend  # noqa: E402
from kvcert.conformance.certification.certify import certify  # noqa: E402
from kvcert.spec.invariants import check_snapshot  # noqa: E402
from kvcert.spec.types import CacheConfig  # noqa: E402

TARGET = "examples.tinycache.adapter:factory"
BUDGET = {"examples": 30, "steps": 30, "seed": 0}


def test_tinycache_adapter_is_a_backend_with_a_clean_fresh_state() -> None:
    backend = adapter.factory(CacheConfig(page_size=4, capacity=64))
    assert isinstance(backend, Backend)
    assert check_snapshot(backend.snapshot()) == []


def test_tinycache_certifies(tmp_path: Path) -> None:
    cert = certify(TARGET, factory=adapter.factory, out_dir=tmp_path, **BUDGET)  # type: ignore[arg-type]
    assert cert.passed, [c.failure for c in cert.cells if not c.passed]
    assert {(c.page_size, c.policy) for c in cert.cells} == {(1, "lru"), (4, "lru"), (16, "lru")}
    assert all(c.steps > 0 for c in cert.cells)
    assert cert.profile == "sglang-0.5.23"  # LRU order is judged, not left to the backend
    assert any(gap.startswith("host tier") for gap in cert.not_checked)  # the certificate says what it skips
    assert not list(tmp_path.iterdir()), "a passing run saves no counterexample"


# --------------------------------------------------------------------------- broken variants


class LockBlindEviction(RadixCache):
    """Evicts any leaf, locked or not: a running request's KV can vanish under it."""

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return node is not self.root and not node.children


class OffByAPrefix(RadixCache):
    """Reports a fully cached key as a miss: the caller keeps (and later frees) the wrong slots."""

    def insert(self, tokens: Sequence[int], slots: Sequence[int], extra_key: str | None = None) -> InsertResult:
        res = super().insert(tokens, slots, extra_key)
        return InsertResult(0 if res.prefix_len == len(tokens) else res.prefix_len, res.last_node)


class HitsDoNotRefresh(RadixCache):
    """A prefix hit does not refresh recency, so LRU evicts the hottest prefix."""

    def match_prefix(self, tokens: Sequence[int], extra_key: str | None = None) -> MatchResult:
        stamps = {node.id: node.last_access for node in self.walk()}
        res = super().match_prefix(tokens, extra_key)
        for node in self.walk():
            node.last_access = stamps.get(node.id, node.last_access)
        return res


@pytest.mark.parametrize(
    ("variant", "rule"),
    [(LockBlindEviction, "INV-EVICT-3"), (OffByAPrefix, "INV-INS-1"), (HitsDoNotRefresh, "INV-EVICT-4")],
)
def test_the_suite_rejects_a_broken_tinycache(
    variant: type[RadixCache], rule: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(adapter, "RadixCache", variant)  # the adapter now builds the broken cache
    cert = certify(TARGET, factory=adapter.factory, out_dir=tmp_path, fail_fast=True, **BUDGET)  # type: ignore[arg-type]
    assert not cert.passed
    cell = next(c for c in cert.cells if not c.passed)
    assert cell.failure is not None and rule in cell.failure, cell.failure
    assert cell.reproduced is True and cell.trace_path is not None and Path(cell.trace_path).exists()
