"""The linker tier's rules (kvcert.spec.linker) and the harness's store (kvcert.conformance.reference.linker), without an engine.

The store is driven as a cache would drive it, right and wrong: each wrong call is judged under the rule it breaks,
and the store itself keeps its own side (claimed pages never lost, results in queue order, loads land whole or
torn, never silently).
"""

from __future__ import annotations

import pytest

from kvcert.conformance.reference.linker import HOLD_STEPS, LinkerStore
from kvcert.spec.linker import FAULTS, RULES

PS = 2


class Device:
    """Slots holding one entry each; the free set is the test's to say."""

    def __init__(self, n: int = 32) -> None:
        self.kv = {s: bytes([s]) * 4 for s in range(n)}
        self.free: set[int] = set()
        self.cached: set[int] = set()

    def store(self, capacity: int = 8) -> LinkerStore:
        return LinkerStore(
            page_size=PS,
            capacity=capacity,
            read=lambda slots: [self.kv[s] for s in slots],
            write=lambda slots, entries: self.kv.update(zip(slots, entries)),
            free_slots=lambda: self.free,
            cached_slots=lambda: self.cached,
        )


def rules(store: LinkerStore) -> set[str]:
    return {v.inv for v in store.violations()}


def offload_two_pages(dev: Device, st: LinkerStore) -> None:
    assert st.offload(["k0", "k1"], [0, 1, 2, 3])
    st.tick()
    assert st.completed() == 1 and st.pop() is True


def test_every_rule_and_fault_is_named() -> None:
    assert {f"INV-LINK-{i}" for i in range(1, 8)} <= set(RULES)  # INV-LINK-8.. are the linker side (test_kvcr_linker)
    assert len(set(FAULTS)) == len(FAULTS) == 8


def test_a_round_trip_moves_the_bytes_and_breaks_no_rule() -> None:
    dev = Device()
    st = dev.store()
    offload_two_pages(dev, st)
    assert st.lookup("r", ["k0", "k1", "k2"]) == [1, 2]
    assert st.load("r", ["k0", "k1"], [10, 11, 12, 13])
    batch = st.start()
    assert st.finish(batch) is True
    assert [dev.kv[s] for s in (10, 11, 12, 13)] == [dev.kv[s] for s in (0, 1, 2, 3)]
    assert rules(st) == set()


def test_a_load_past_its_lookup_or_without_one_breaks_link_1() -> None:
    dev = Device()
    st = dev.store()
    offload_two_pages(dev, st)
    assert st.lookup("r", ["k0", "kx"]) == [1]
    st.load("r", ["k0", "kx"], [10, 11, 12, 13])
    assert rules(st) == {"INV-LINK-1"}
    st.load("q", ["k0"], [20, 21])
    assert rules(st) == {"INV-LINK-1"}


def test_a_load_into_free_or_cached_slots_breaks_link_2_and_an_uncancelled_one_link_3() -> None:
    dev = Device()
    st = dev.store()
    offload_two_pages(dev, st)
    dev.cached = {10}
    st.lookup("r", ["k0"])
    st.load("r", ["k0"], [10, 11])
    assert rules(st) == {"INV-LINK-2"}
    dev.cached = set()
    st.lookup("q", ["k1"])
    st.load("q", ["k1"], [20, 21])
    dev.free = {20, 21}  # q let its slots go and its load was never cancelled
    st.start()
    assert "INV-LINK-3" in rules(st)


def test_results_publish_in_queue_order_and_a_held_offload_holds_the_ones_behind_it() -> None:
    dev = Device()
    st = dev.store()
    st.arm("offload_hold")
    assert st.offload(["a"], [0, 1]) and st.offload(["b"], [2, 3])
    st.tick()
    assert st.completed() == 0  # b is done, a is not: b waits behind it
    for _ in range(HOLD_STEPS):
        st.tick()
    assert st.completed() == 2 and st.pop() and st.pop()
    assert st.pop() is False and rules(st) == {"INV-LINK-6"}  # a result that was not published


def test_a_failed_page_fails_the_whole_offload_and_a_changed_source_breaks_link_5() -> None:
    dev = Device()
    st = dev.store()
    st.arm("offload_fail")
    st.offload(["a", "b"], [0, 1, 2, 3])
    dev.kv[2] = b"\xff" * 4  # the cache let a source slot go while the offload was in flight
    st.tick()
    assert st.pop() is False
    assert rules(st) == {"INV-LINK-5"}


def test_a_node_marked_stored_needs_an_offload_that_succeeded() -> None:
    dev = Device()
    st = dev.store()
    st.arm("offload_fail")
    st.offload(["a", "b"], [0, 1, 2, 3])
    st.tick()
    st.pop()
    st.ledger.marks("7", ["a", "b"])
    assert rules(st) == {"INV-LINK-6"}


def test_a_failed_batch_tears_the_slots_and_names_its_requests() -> None:
    dev = Device()
    st = dev.store()
    offload_two_pages(dev, st)
    st.lookup("r", ["k0", "k1"])
    st.load("r", ["k0", "k1"], [10, 11, 12, 13])
    st.arm("load_fail")
    batch = st.start()
    assert st.finish(batch) is False and st.ledger.failed == {"r"}
    assert dev.kv[10] == dev.kv[0] and dev.kv[12] == bytes(4)  # its first page landed, the rest is torn
    assert rules(st) == set()


def test_capacity_and_drops_never_take_a_claimed_page() -> None:
    dev = Device()
    st = dev.store(capacity=2)
    offload_two_pages(dev, st)
    st.lookup("r", ["k0", "k1"])
    st.arm("drop")
    assert set(st.pages) == {"k0", "k1"}  # both claimed: nothing to drop
    assert st.offload(["k2"], [4, 5])
    st.tick()
    assert st.pop() is False  # full of claimed pages: the offload fails, it does not evict a claim
    st.release("r")
    st.arm("drop")
    assert list(st.pages) == ["k1"]
    with pytest.raises(ValueError):
        st.arm("melt")


@pytest.mark.parametrize("kind", ["corrupt", "truncate"])
def test_a_page_damaged_at_rest_fails_its_batch_instead_of_landing(kind: str) -> None:
    dev = Device()
    st = dev.store()
    offload_two_pages(dev, st)
    st.lookup("r", ["k0", "k1"])
    st.load("r", ["k0", "k1"], [10, 11, 12, 13])
    st.arm(kind)
    assert st.finish(st.start()) is False and st.ledger.failed == {"r"}


def test_a_load_left_queued_when_no_request_is_left_breaks_link_7() -> None:
    dev = Device()
    st = dev.store()
    offload_two_pages(dev, st)
    st.lookup("r", ["k0"])
    st.load("r", ["k0"], [10, 11])
    st.ledger.idle()
    assert rules(st) == {"INV-LINK-7"}
    st.finish(st.start())
    st.ledger.idle()
    assert rules(st) == set()
