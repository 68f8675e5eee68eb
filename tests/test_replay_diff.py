"""`kvcert replay --diff-at N`: the backend's snapshot beside the oracle's, and the pure rows it renders."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from typer.testing import CliRunner

from kvcert.conformance.certification.diff import snapshot_rows
from kvcert.conformance.cli import app
from kvcert.refimpl import RefCache
from kvcert.spec.ops import Trace
from kvcert.spec.types import CacheConfig

EVICT_LOCKED = Path(__file__).parent / "corpus" / "zoo" / "kvcert.conformance.zoo_evict_locked-ps1-lru-seed0.json"
"""Insert, Lock, Evict: the evict_locked mutant evicts the locked node at step 2 (INV-EVICT-3, INV-TREE-4);
the unmodified model passes it."""


def _replay(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, ["replay", str(EVICT_LOCKED), *args])
    return res.exit_code, res.output


def test_the_trace_is_what_the_tests_assume() -> None:
    trace = Trace.from_json(EVICT_LOCKED.read_text())
    assert trace.target == "kvcert.conformance.zoo:evict_locked" and len(trace.ops) == 3


def test_diff_at_the_failing_step_shows_the_evicted_node() -> None:
    code, out = _replay("--diff-at", "2")
    assert code == 1, out
    assert "step 2: backend (mutant:evict_locked)" in out
    assert "before step" not in out  # it failed at step 2 itself
    assert "rows differ" in out and "protected_size" in out.split("rows differ")[1]
    assert "INV-EVICT-3" in out


def test_diff_past_the_failure_shows_the_failing_step_and_says_so() -> None:
    code, out = _replay("--diff-at", "5")
    assert code == 1, out
    assert "the trace failed at step 2, before step 5" in out
    assert "step 2: backend" in out and "rows differ" in out


def test_diff_on_a_passing_replay_agrees_everywhere() -> None:
    code, out = _replay("--diff-at", "1", "--target", "kvcert.refimpl:factory")
    assert code == 0, out
    assert "backend and oracle agree on every row" in out and "PASS" in out


def test_diff_past_the_end_exits_2() -> None:
    code, out = _replay("--diff-at", "99", "--target", "kvcert.refimpl:factory")
    assert code == 2
    assert "past the end" in out


def test_negative_step_exits_2() -> None:
    assert _replay("--diff-at", "-1")[0] == 2


def test_rows_match_nodes_by_path_not_id() -> None:
    """Two models that built the same tree in another order (other node ids) agree row for row."""
    config = CacheConfig(page_size=1, capacity=16)
    a, b = RefCache(config), RefCache(config)
    a.insert(None, (1, 2, 3), a.alloc(3))
    a.insert(None, (7,), a.alloc(1))
    b.insert(None, (7,), b.alloc(1))
    b.insert(None, (1, 2, 3), b.alloc(3))
    rows = snapshot_rows(a.snapshot(), b.snapshot())
    assert not [r for r in rows if r.differs]
    assert [r.key for r in rows if r.section == "node"] == ["1 2 3", "7"]


def test_rows_mark_what_differs() -> None:
    config = CacheConfig(page_size=1, capacity=16)
    cache = RefCache(config)
    cache.insert(None, (1, 2), cache.alloc(2))
    snap = cache.snapshot()
    (node,) = [n for n in snap.nodes if n.id != snap.root]
    locked = replace(
        snap,
        nodes=tuple(replace(n, lock_ref=1) if n.id == node.id else n for n in snap.nodes),
        evictable_size=0,
        protected_size=2,
    )
    rows = {r.key: r for r in snapshot_rows(locked, snap)}
    assert rows["1 2"].differing == ("lock_ref",)
    assert rows["1 2"].cells[2] == ("lock_ref", "1", "0")
    assert rows["evictable_size"].differs and rows["protected_size"].differs
    assert not rows["free device slots"].differs
    # a node only one side holds: every field differs, the other side reads "-"
    rows = {r.key: r for r in snapshot_rows(snap, RefCache(config).snapshot())}
    assert rows["1 2"].cells[0] == ("device slots", "2", "-")
