"""`kvcert.gpu.run`: a Run counts and cuts in items, never bytes; the API's conversions check their input."""

from __future__ import annotations

import random
from array import array

import pytest
import torch

from kvcert.gpu.run import EMPTY, Run, ints_run, key_run, slot_run, slots_of
from kvcert.spec.types import InvalidToken


def run(*items: int) -> Run:
    return Run.of_ints(items)


def test_length_indices_and_slices_count_items() -> None:
    r = run(5, 6, 7, 8)
    assert len(r) == 4 and len(r.raw) == 32  # the bytes are there, only as .raw
    assert r[0] == 5 and r[-1] == 8
    assert r[1:3] == run(6, 7) and r[:0] == EMPTY and r[3:1] == EMPTY
    assert r.head(1) == run(5) and r.tail(3) == run(8) and r.cut(1, 3) == run(6, 7)
    assert r.to_tuple() == (5, 6, 7, 8) and repr(r) == "Run((5, 6, 7, 8))"
    with pytest.raises(ValueError):
        r[::2]


def test_startswith_takes_an_item_offset() -> None:
    r = run(1, 2, 3, 4)
    assert r.startswith(run(3, 4), 2) and not r.startswith(run(3, 4), 1)
    assert r.startswith(EMPTY, 4) and not r.startswith(run(4, 5), 3)


def test_common_is_the_longest_whole_page_prefix() -> None:
    rng = random.Random(0)
    for _ in range(400):
        ps = rng.choice([1, 2, 4])
        pages = rng.randrange(1, 6)
        edge = [rng.randrange(2) for _ in range(ps * pages)]
        at = ps * rng.randrange(3)
        key = (
            [rng.randrange(2) for _ in range(at)] + edge[:ps] + [rng.randrange(2) for _ in range(ps * rng.randrange(6))]
        )
        end = len(key) - ps * rng.randrange((len(key) - at) // ps)
        want = ps  # the first page matches, given
        while want + ps <= min(len(edge), end - at) and key[at : at + want + ps] == edge[: want + ps]:
            want += ps
        assert Run.of_ints(key).common(Run.of_ints(edge), at, end, ps) == want


def test_join_and_tensor_copy() -> None:
    parts = [run(1, 2), EMPTY, run(3)]
    joined = Run.join(parts)
    assert joined == run(1, 2, 3) and hash(joined) == hash(run(1, 2, 3)) and parts[0].tail(0) is parts[0]
    t = joined.tensor()
    assert t.dtype is torch.int64 and t.tolist() == [1, 2, 3]
    node_run = run(4, 5)  # bytes-backed, as nodes hold them: its tensor is a copy
    u = node_run.tensor()
    u[0] = 9
    assert node_run == run(4, 5) and EMPTY.tensor().numel() == 0


@pytest.mark.parametrize(
    "key",
    [
        array("q", [1, 2, 3]),
        array("i", [1, 2, 3]),
        torch.tensor([1, 2, 3]),
        torch.tensor([1, 2, 3], dtype=torch.int32),
        torch.tensor([1, 0, 2, 0, 3])[::2],  # non-contiguous
        array("q", [1, 2, 3]).tobytes(),
        bytearray(array("q", [1, 2, 3]).tobytes()),
        [1, 2, 3],
        (1, 2, 3),
    ],
)
def test_key_run_takes_every_key_form(key: object) -> None:
    assert key_run(key) == run(1, 2, 3)


@pytest.mark.parametrize(
    "key",
    [array("d", [1.0]), torch.tensor([1.0]), torch.zeros(2, 2, dtype=torch.int64), b"1234567", [-1], [2**63], "ab", 5],
)
def test_key_run_rejects_what_is_not_token_ids(key: object) -> None:
    with pytest.raises(InvalidToken):
        key_run(key)
    with pytest.raises(InvalidToken):
        ints_run([2**63])


def test_slot_run_counts_slots_and_flags_non_ids() -> None:
    want = run(4, 5)
    for slots in (
        torch.tensor([4, 5]),
        torch.tensor([4, 5], dtype=torch.int16),
        array("q", [4, 5]),
        array("b", [4, 5]),
    ):
        assert slot_run(slots) == (2, want)
    assert slot_run(array("q", [4, 5]).tobytes()) == (2, want) and slot_run([4, 5]) == (2, want)
    assert slot_run(torch.tensor([1.0, 2.0])) == (2, None) and slot_run(b"123456789") == (1, None)
    assert slot_run([1, True]) == (2, None) and slot_run("ab") == (0, None) and slot_run(array("d", [1.0])) == (1, None)
    assert slots_of([4, 5]) == want and slots_of([4, 2**64]) is None
