"""What `bench meta`'s shims and clock cost, measured side by side: SGLang's `RadixCache`, and `kvcert.gpu`.

    KVCERT_SGLANG=1 .venv/bin/python scripts/bench_shims.py [--requests 10000] [--rounds 2]

`bench meta` gives SGLang's `RadixCache` an insertion-ordered set of leaves (`OrderedSet`, a
Python class, instead of the builtin `set` of address-hashed nodes) and reads its `time` from the
bench's logical clock, so that ties break alike in every run and every implementation answers
every request alike. Both are Python-level calls in SGLang's hot path, so they slow the baseline
every ratio in docs/bench.md divides by. This replays the bench's trace on the shimmed driver and
on SGLang as it ships (builtin set, wall clock), alternating, in one process, and prints calls/s
of each and their ratio: the bias the shims put into kvcert's ratios.

Then the same for `kvcert.gpu`'s tensor API with the bench's logical clock (every call at its own
time, as now) against its clock left at 0 (as `bench meta` did before: every node stamped 0, so
no touch reorders its eviction heaps): what a real clock costs kvcert.gpu.
"""

from __future__ import annotations

import argparse
import contextlib
from functools import partial
from typing import Any

from kvcert.conformance.bench import meta as bench


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


class _FrozenClock(bench.GpuNativeDriver):
    """kvcert.gpu's tensor API with its clock never set (0 throughout)."""

    def tick(self, now: int) -> None:
        pass


def _gpu(ps: int, capacity: int, frozen: bool) -> bench.Driver:
    from kvcert import gpu
    from kvcert.spec.types import CacheConfig

    cls = _FrozenClock if frozen else bench.GpuNativeDriver
    return cls("kvcert.gpu", gpu.factory(CacheConfig(page_size=ps, capacity=capacity)))


def _side_by_side(trace: list[bench.Request], rounds: int, makers: dict) -> dict:
    rates: dict[str, list[float]] = {k: [] for k in makers}
    for _ in range(rounds):  # alternate, so drift on a shared machine falls on both alike
        for key, make in makers.items():
            res = bench.replay(make(), trace, budget=1e9)
            assert not res.error, res.error
            rates[key].append(res.total_rate or 0.0)
    return {k: sum(v) / len(v) for k, v in rates.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--pages", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--page-size", type=int, action="append", default=None)
    args = ap.parse_args()
    sizes = args.page_size or [1, 64]
    traces = {
        ps: bench.make_trace(bench.TraceSpec(page_size=ps, pages=args.pages, requests=args.requests)) for ps in sizes
    }
    comparisons = [  # (what bench meta runs, what it is compared with, the pair of drivers)
        ("SGLang RadixCache shimmed (bench meta)", "as shipped", (bench.SGLangRadixDriver, _AsShipped)),
        (
            "kvcert.gpu, logical clock (bench meta)",
            "clock at 0",
            (partial(_gpu, frozen=False), partial(_gpu, frozen=True)),
        ),
    ]
    for ours, theirs, (make_a, make_b) in comparisons:
        print(f"| page size | {ours} calls/s | {theirs} calls/s | ratio |")
        print("|---|---|---|---|")
        for ps in sizes:
            cap = args.pages * ps
            r = _side_by_side(traces[ps], args.rounds, {"a": partial(make_a, ps, cap), "b": partial(make_b, ps, cap)})
            print(f"| {ps} | {r['a']:,.0f} | {r['b']:,.0f} | {r['a'] / r['b']:.3f} |")
        print()


if __name__ == "__main__":
    main()
