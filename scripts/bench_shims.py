"""What `bench meta`'s determinism shims cost SGLang's `RadixCache`, measured side by side.

    KVCERT_SGLANG=1 .venv/bin/python scripts/bench_shims.py [--requests 10000] [--rounds 2]

`bench meta` gives SGLang's `RadixCache` an insertion-ordered set of leaves (`OrderedSet`, a
Python class, instead of the builtin `set` of address-hashed nodes) and reads its `time` from the
bench's logical clock, so that ties break alike in every run and every implementation answers
every request alike. Both are Python-level calls in SGLang's hot path, so they slow the baseline
every ratio in docs/bench.md divides by. This replays the bench's trace on the shimmed driver and
on SGLang as it ships (builtin set, wall clock), alternating, in one process, and prints calls/s
of each and their ratio: the bias the shims put into kvcert's ratios.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from kvcert.conformance import bench


class _AsShipped(bench.SGLangRadixDriver):
    """SGLang's RadixCache with its own set of leaves and its own clock."""

    name = "sglang RadixCache (as shipped)"

    def __init__(self, page_size: int, capacity: int) -> None:
        super().__init__(page_size, capacity)
        self.cache.evictable_leaves = set(self.cache.evictable_leaves)

    def tick(self, now: int) -> None:
        pass

    def session(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--pages", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--page-size", type=int, action="append", default=None)
    args = ap.parse_args()
    print("| page size | shimmed (bench meta) calls/s | as shipped calls/s | shimmed / as shipped |")
    print("|---|---|---|---|")
    for ps in args.page_size or [1, 64]:
        trace = bench.make_trace(bench.TraceSpec(page_size=ps, pages=args.pages, requests=args.requests))
        rates: dict[str, list[float]] = {"shim": [], "ship": []}
        for _ in range(args.rounds):  # alternate, so drift on a shared machine falls on both alike
            for key, make in (("shim", bench.SGLangRadixDriver), ("ship", _AsShipped)):
                res = bench.replay(make(ps, args.pages * ps), trace, budget=1e9)
                assert not res.error, res.error
                rates[key].append(res.total_rate or 0.0)
        shim, ship = (sum(v) / len(v) for v in (rates["shim"], rates["ship"]))
        print(f"| {ps} | {shim:,.0f} | {ship:,.0f} | {shim / ship:.3f} |")


if __name__ == "__main__":
    main()
