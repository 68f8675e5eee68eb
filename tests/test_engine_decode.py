"""Decode-side admission (SPEC.md §15): the ledger's rules on hand-made histories, and kvcert's reference decode
server (conformance/reference/engine_decode.py), their positive control, certified over the reference model and kvcert.gpu
with peer faults, restored spans and requests that can never fit all reached. The rules' power on a broken
server is the engine zoo's (tests/test_engine_zoo.py)."""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import pytest

from kvcert.conformance.certification.certify import certify
from kvcert.spec.decode import RULES, DecodeLedger

FREE, CACHED, LOCKED = {20, 21}, {0, 1, 2, 3}, {0, 1}


def _rules(ledger: DecodeLedger) -> set[str]:
    return {v.inv for v in ledger.found}


def test_a_correct_history_passes() -> None:
    ledger = DecodeLedger()
    ledger.promise("a", 5, 2, (0, 1), (10, 11, 12), 0, FREE, CACHED, LOCKED)
    ledger.held(FREE, CACHED, LOCKED)
    ledger.commit("a", (0, 1, 10, 11, 12), CACHED, LOCKED)
    ledger.promise("b", 3, 0, (), (13, 14, 15), 0, FREE, CACHED, LOCKED)
    ledger.fail("b", CACHED)
    assert not ledger.found and ledger.failed == {"b"}


@pytest.mark.parametrize(
    "dest, device, rule",
    [
        ((10, 11), (0, 1), "INV-DEC-1"),  # one slot short
        ((10, 11, 20), (0, 1), "INV-DEC-1"),  # a free slot
        ((10, 11, 2), (0, 1), "INV-DEC-1"),  # a slot of the tree
        ((10, 11, 12), (0, 2), "INV-DEC-2"),  # a device prefix slot not locked
    ],
)
def test_a_promise_breaks_its_rule(dest: tuple[int, ...], device: tuple[int, ...], rule: str) -> None:
    ledger = DecodeLedger()
    ledger.promise("a", 5, 2, device, dest, 0, FREE, CACHED, LOCKED)
    assert _rules(ledger) == {rule}


def test_two_transfers_never_share_a_destination() -> None:
    ledger = DecodeLedger()
    ledger.promise("a", 3, 0, (), (10, 11, 12), 0, FREE, CACHED, LOCKED)
    ledger.promise("b", 3, 0, (), (12, 13, 14), 0, FREE, CACHED, LOCKED)
    assert _rules(ledger) == {"INV-DEC-1"}


def test_a_transfer_in_flight_keeps_its_prefix_and_destination() -> None:
    ledger = DecodeLedger()
    ledger.promise("a", 5, 2, (0, 1), (10, 11, 12), 0, FREE, CACHED, LOCKED)
    ledger.held(FREE, CACHED, {0})  # the prefix's lock dropped
    ledger.held(FREE | {10}, CACHED, LOCKED)  # a destination slot freed
    assert [v.inv for v in ledger.found] == ["INV-DEC-3", "INV-DEC-3"]


def test_a_commit_reads_its_prefix_and_destination() -> None:
    ledger = DecodeLedger()
    ledger.promise("a", 5, 2, (0, 1), (10, 11, 12), 0, FREE, CACHED, LOCKED)
    ledger.commit("a", (0, 1, 10, 11, 13), CACHED, LOCKED)  # the prefill's bytes are elsewhere
    ledger.promise("b", 5, 3, (0, 1), (10, 11), 1, FREE, CACHED, LOCKED)  # a restored token never restored
    ledger.commit("b", (0, 1, 7, 10, 11), CACHED, LOCKED)
    ledger.commit("c", (0, 1), CACHED, LOCKED)  # never promised
    assert [v.inv for v in ledger.found] == ["INV-DEC-4"] * 3


def test_a_failed_transfer_caches_nothing_of_its_destination() -> None:
    ledger = DecodeLedger()
    ledger.promise("a", 3, 0, (), (10, 11, 12), 0, FREE, CACHED, LOCKED)
    ledger.fail("a", CACHED | {11})
    ledger.promise("b", 3, 0, (), (13, 14, 15), 0, FREE, CACHED, LOCKED)
    ledger.abort("b", CACHED | {15})
    assert [v.inv for v in ledger.found] == ["INV-DEC-5", "INV-DEC-5"]


def test_every_rule_is_in_the_spec() -> None:
    spec = (Path(__file__).parents[1] / "spec" / "SPEC.md").read_text()
    assert all(f"| {rule} |" in spec for rule in RULES), sorted(RULES)


@pytest.mark.parametrize("target", ["factory", "factory_gpu"])
def test_the_reference_decode_server_certifies_and_reaches_every_failure_path(target: str) -> None:
    with tempfile.TemporaryDirectory() as out:
        cert = certify(f"kvcert.conformance.reference.engine_decode:{target}", examples=30, page_sizes=(4,),
                       policies=("lru",), write_policies=("write_through",), device_cells=False,
                       out_dir=Path(out))  # fmt: skip
    assert cert.passed, [f for c in cert.cells for f in c.failures]
    ops: Counter[str] = Counter()
    for c in cert.cells:
        ops.update(c.ops)
    for reached in ("decode:commit", "decode:commit with a restore", "decode:transfer failed",
                    "decode:refused at arrival", "decode:aborted in transfer"):  # fmt: skip
        assert ops[reached] > 0, (reached, {k: v for k, v in ops.items() if k.startswith("decode:")})
