"""SGLang 0.5.23's decode server of PD disaggregation (conformance/adapters/sglang/decode.py): its own decode event
loop, prealloc and transfer queues and decode-side HiCache, certified through its request path; and the bugs PR
#26560's review found (seed 003), planted into SGLang's own code (tests/sglang_decode_plants.py), each failing the
certification under the rule it breaks. Skipped as a whole without the `sglang` extra (required with
KVCERT_SGLANG=1)."""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import pytest
from _sglang import require_sglang

require_sglang()

import sglang_decode_plants as plants  # noqa: E402

from kvcert.conformance.adapters.sglang import decode as sglang_decode  # noqa: E402
from kvcert.conformance.certification import fixes, known  # noqa: E402
from kvcert.conformance.certification.certify import certify, load_factory  # noqa: E402
from kvcert.conformance.certification.replay import replay  # noqa: E402
from kvcert.conformance.harness.driver import ConformanceFailure  # noqa: E402
from kvcert.conformance.harness.requests import RequestHarness  # noqa: E402
from kvcert.spec.ops import PeerFault, Step, Submit, Trace  # noqa: E402
from kvcert.spec.types import CacheConfig  # noqa: E402

pytestmark = pytest.mark.sglang

TARGET = "kvcert.conformance.adapters.sglang.decode:factory_fitting"
"""The client sends no request that can never fit: `factory`'s fail on finding SG-DECODE-NEVER-FIT (test_known_findings
replays it)."""
STORAGE_TARGET = "kvcert.conformance.adapters.sglang.decode:factory_storage"
L3_WAIT = "SG-DECODE-L3-WAIT"
"""The storage cells run with this finding's fix applied (else every cell stops at its leak)."""
STORAGE_EXAMPLES = 12
"""Examples per storage cell (write-through, page sizes 1 and 4): enough to issue L3 prefetches that load tokens."""
EXAMPLES = 20
"""Examples per host cell: enough for the unmodified engine to restore L2 prefixes and fail restored transfers."""

CAUGHT = {
    "commit-keeps-device-lock": {"INV-LIVE-1"},
    "unevict-frees-host-copy": {"INV-HOST-4", "INV-HOST-5"},
}
"""Each plant the certification reaches, and the rules any of which its failure must name. `failed-restore-keeps-lock`
is judged on a directed trace (`_restore`): the prefill peer fails a transfer while its span is restoring."""

STORAGE_CAUGHT = {
    "prefetch-never-issued": {"INV-RP-5"},
}
"""Plants only the storage target reaches: the prefill was promised the L3 span, nothing loads it, the restore fails
and SGLang aborts the request (500, "HiCache restore failed") though its client did not ask and nothing failed."""

LEAK_TRACE = (
    Submit(request="r000002", namespace=None, tokens=(0, 2, 1), priority=0, output=4),
    Step(),
    Step(),
    Step(),
    Submit(request="r000003", namespace=None, tokens=(0, 2, 1, 1, 0), priority=0, output=2),
)
"""Finding SG-DECODE-L3-WAIT's minimal trace (page size 1, write_through; `kvcert certify ...:factory_storage` shrank
it): the second prompt's suffix is in L3 (SGLang's own backup of the first request's output), its prefetch is still
running at the transfer queue's first poll, the timeout policy opens a wait entry, and nothing on the decode path
closes it."""


@functools.cache
def _run_storage(plant: str) -> dict[str, Any]:
    """The storage target's write-through cells certified under `plant`, with SG-DECODE-L3-WAIT fixed (else every
    cell stops at that leak)."""
    reached: Counter[str] = Counter()
    with tempfile.TemporaryDirectory() as out, plants.counted(reached), plants.planted(plant):
        cert = certify(
            STORAGE_TARGET,
            examples=STORAGE_EXAMPLES,
            out_dir=Path(out),
            device_cells=False,
            write_policies=["write_through"],
            with_fixes=[L3_WAIT],
        )
    rules = sorted({f["invariant"] for c in cert.cells for f in c.failures})
    return {"passed": cert.passed, "rules": rules, "reached": dict(reached), "steps": sum(c.steps for c in cert.cells)}


@functools.cache
def _run(plant: str) -> dict[str, Any]:
    """The host cells (page sizes 1 and 4, three write policies) certified under `plant`, once per test process."""
    reached: Counter[str] = Counter()
    with tempfile.TemporaryDirectory() as out, plants.counted(reached), plants.planted(plant):
        cert = certify(TARGET, examples=EXAMPLES, out_dir=Path(out), device_cells=False)
    rules = sorted({f["invariant"] for c in cert.cells for f in c.failures})
    ops: Counter[str] = Counter()
    for c in cert.cells:
        ops.update(c.ops)
    return {"passed": cert.passed, "rules": rules, "reached": dict(reached), "steps": sum(c.steps for c in cert.cells),
            "ops": dict(ops)}  # fmt: skip


def _restore(fault: bool) -> tuple[RequestHarness, Counter[str]]:
    """Two requests share a prefix; the first's KV is backed up, then evicted by a second, and the third restores it
    from the host: SGLang's load-back runs. With `fault`, the prefill peer fails the third's transfer while the
    restored span is locked for it (PeerFault), and SGLang must clean up behind it. The harness is left open."""
    config = CacheConfig(page_size=4, policy="lru", capacity=32, host_capacity=64, write_policy="write_through")
    h = RequestHarness(sglang_decode.factory(config), config, sglang_decode.factory.capabilities)
    reached: Counter[str] = Counter()
    try:
        with plants.counted(reached):
            prefix = tuple(range(1, 13))
            for rid, tokens in (("a", prefix), ("b", tuple(range(40, 60))), ("c", prefix + (90, 91, 92, 93))):
                h.step(Submit(request=rid, namespace=None, tokens=tokens, priority=0, output=2))
                if fault and rid == "c":
                    h.step(PeerFault("transfer_fail"))
                for _ in range(8):
                    h.step(Step())
            h.quiesce()
    except BaseException:
        h.close()
        raise
    return h, reached


def test_a_prompt_with_an_l2_prefix_is_restored_and_decodes() -> None:
    """Every step's bytes (device, host, each request's row) are right, and the restored span reached the row."""
    h, reached = _restore(fault=False)
    h.close()
    assert reached["l2_hits"] >= 1 and reached["restores"] >= 1, reached
    assert {r: v.state for r, v in h.finished.items()} == {"a": "finished", "b": "finished", "c": "finished"}


def test_a_transfer_failed_mid_restore_is_cleaned_up() -> None:
    """SPEC.md §15, INV-DEC-5: the peer fails the restoring request's transfer; SGLang aborts it (excused: its
    transfer failed), drops the restored span's lock, and nothing it held outlives it. With the review's lock leak
    planted (`failed-restore-keeps-lock`), the same trace fails INV-LIVE-1."""
    h, reached = _restore(fault=True)
    h.close()
    assert reached["failed_with_restore_lock"] == 1, reached
    assert {r: v.state for r, v in h.finished.items()} == {"a": "finished", "b": "finished"}
    with plants.planted("failed-restore-keeps-lock"), pytest.raises(ConformanceFailure) as caught:
        _restore(fault=True)
    assert {v.inv for v in caught.value.violations} == {"INV-LIVE-1"}, caught.value


def test_the_unmodified_engine_is_certified() -> None:
    """Every cell at a small budget, device-only ones included: CERTIFIED."""
    with tempfile.TemporaryDirectory() as out:
        cert = certify(TARGET, examples=8, out_dir=Path(out))
    assert cert.passed, [c.failure for c in cert.cells if not c.passed]
    assert {c.page_size for c in cert.cells} == {1, 4} and any(not c.write_policy for c in cert.cells)
    said = " ".join(cert.not_checked)
    assert "transfer backend: SGLang's fake one" in said and "distinct-ids" in said


def test_the_host_cells_reach_restores_and_failed_restores() -> None:
    """The run the plants are judged against: CERTIFIED, and it reached what each plant breaks, and every decode
    admission path SPEC.md §15 judges (promises with a restored span, commits, transfers the peer failed)."""
    clean = _run("none")
    assert clean["passed"] and clean["rules"] == [], clean
    reached = clean["reached"]
    for path in ("decode:commit with a restore", "decode:transfer failed", "decode:aborted in transfer"):
        assert clean["ops"].get(path, 0) > 0, (path, clean["ops"])
    assert reached.get("l2_hits", 0) > 0 and reached.get("restores", 0) > 0, reached
    assert reached.get("unevicted", 0) > 0, reached


@pytest.mark.parametrize("plant", sorted(CAUGHT))
def test_a_planted_bug_fails_under_the_rule_it_breaks(plant: str) -> None:
    got = _run(plant)
    assert not got["passed"] and set(got["rules"]) & CAUGHT[plant], got


def _replay_leak(fixed: bool) -> tuple[Optional[str], Counter[str]]:
    config = CacheConfig(page_size=1, policy="lru", capacity=24, host_capacity=48, write_policy="write_through")
    h = RequestHarness(sglang_decode.factory_storage(config), config, sglang_decode.factory_storage.capabilities)
    reached: Counter[str] = Counter()
    fix = fixes.applied([L3_WAIT], STORAGE_TARGET) if fixed else contextlib.nullcontext()
    with plants.counted(reached), fix:
        try:
            for op in LEAK_TRACE:
                h.step(op)
            h.quiesce()
        except ConformanceFailure as failure:
            return str(failure), reached
        finally:
            h.close()
    return None, reached


def test_the_decode_path_leaks_a_prefetch_wait_per_l3_hit() -> None:
    """Finding SG-DECODE-L3-WAIT: unmodified, the trace's L3 hit leaves its `_storage_prefetch_wait` entry behind
    (INV-LIVE-2); with the finding's fix (the decode path closes it as the normal scheduler's admission does), the
    same trace passes, and its prefetch loaded the second prompt's suffix from L3."""
    failure, reached = _replay_leak(fixed=False)
    assert failure is not None and "INV-LIVE-2: cache._storage_prefetch_wait holds 1 entries" in failure, failure
    failure, reached = _replay_leak(fixed=True)
    assert failure is None, failure
    assert reached["l3_hits"] == 1 and reached["l3_prefetches"] == 1 and reached["l3_tokens_loaded"] > 0, reached


def test_the_storage_cells_reach_l3_and_certify_with_the_leak_fixed() -> None:
    clean = _run_storage("none")
    assert clean["passed"] and clean["rules"] == [], clean
    reached = clean["reached"]
    assert reached.get("l3_hits", 0) > 0 and reached.get("l3_prefetches", 0) > 0, reached
    assert reached.get("l3_tokens_loaded", 0) > 0, reached


@pytest.mark.parametrize("plant", sorted(STORAGE_CAUGHT))
def test_a_planted_prefetch_bug_fails_under_the_rule_it_breaks(plant: str) -> None:
    got = _run_storage(plant)
    assert not got["passed"] and set(got["rules"]) & STORAGE_CAUGHT[plant], got


RETRACT = "SG-DECODE-RETRACT-FINISHED"
CLIPPED = "sglang_decode/SG-DECODE-RETRACT-FINISHED-running-request-aborted.json"
"""The finding's trace, once logged as SG-DECODE-NEVER-FIT: the harness judged r000009 by the client's output."""
AT_DEFAULT_RESERVE = Path(__file__).parent / "data" / "sg_decode_retract_finished_reserve_512.json"
"""The finding at SGLang's default reserve, on a pool of 5200 slots (2155 steps: too long to replay before every
certification of the decode targets, so the log's trace is the reserve-4 one)."""


def _play(trace: Trace) -> tuple[RequestHarness, Optional[ConformanceFailure]]:
    """`trace` on `factory` (`--num-reserved-decode-tokens 4`), then quiesced: the harness and the failure, if any."""
    h = RequestHarness(sglang_decode.factory(trace.config), trace.config, sglang_decode.factory.capabilities)
    try:
        for op in trace.ops:
            h.step(op)
        h.quiesce()
    except ConformanceFailure as failure:
        return h, failure
    finally:
        h.close()
    return h, None


def test_a_request_sglang_clips_on_arrival_is_judged_by_its_clipped_output() -> None:
    """INV-DEC-6 judges the engine's request, not the client's: r000009 asks for 44 prompt and 23 output tokens of a
    64-slot pool, SGLang clips its output on arrival to 18 (init_req_max_new_tokens), so it fits, and no abort is
    blamed on it. What the old verdict had found is SG-DECODE-RETRACT-FINISHED: r000011, the request running beside
    r000009's transfer, is aborted for OOM (INV-RP-5); with that finding's fix the same trace passes."""
    trace = Trace.from_json(known.trace_text(CLIPPED))
    h, failure = _play(trace)
    clipped = h.sent["r000009"]
    assert clipped.op.output == 23 and clipped.output == 18, (clipped.op.output, clipped.output)
    assert h.never_fits(clipped.op) and not h.never_fits(clipped.op, clipped.output)
    assert failure is not None and {v.inv for v in failure.violations} == {"INV-RP-5"}, failure
    assert "r000011 was aborted" in str(failure)
    with fixes.applied([RETRACT], "kvcert.conformance.adapters.sglang.decode:factory"):
        h, failure = _play(trace)
    assert failure is None, failure
    assert {r: v.state for r, v in h.finished.items()} == dict.fromkeys(("r000002", "r000009", "r000011"), "finished")


def test_at_the_default_reserve_a_finished_request_is_not_counted_retractable() -> None:
    """Finding SG-DECODE-RETRACT-FINISHED at SGLang's own --num-reserved-decode-tokens 512, so not an artefact of the
    cells' small reserve: the trace fails INV-RP-5 on the released decode server and passes with the finding's fix
    applied in-process (the patch docs/upstream hands upstream)."""
    trace = Trace.from_json(AT_DEFAULT_RESERVE.read_text())
    make = load_factory(trace.target)
    got = replay(make, make.capabilities, trace.config, trace.ops)  # type: ignore[attr-defined]
    assert got.failure is not None and {v.inv for v in got.failure.violations} == {"INV-RP-5"}, got.failure
    with fixes.applied([RETRACT], trace.target) as done:
        assert [f.finding for f in done] == [RETRACT]
        got = replay(make, make.capabilities, trace.config, trace.ops)  # type: ignore[attr-defined]
    assert got.failure is None, got.failure
