"""How often a storage certification of SGLang reaches its admission limit and mid-batch prefetch ends.

    KVCERT_SGLANG=1 .venv/bin/python scripts/storage_reach.py factory_storage --examples 60

Counts, over the storage cells of `sglang_hicache_backend:<factory>` (seed 0, 50 steps an example):
SGLang's own `prefetch_rate_limited` answers (declined / admitted), and how the prefetches that
`check_prefetch_progress` ended stood: mid-batch keeping nothing (progress not yet published),
after a miss keeping the pages before it. The counters wrap the engine's methods; nothing else changes.
"""

from __future__ import annotations

import argparse
import collections
from typing import Any, Optional

from kvcert.conformance.adapters.sglang.env import import_sglang

import_sglang()  # SGLang's CPU import shims, before any sglang module

from sglang.srt.managers import cache_controller as cc  # noqa: E402

from kvcert.conformance.adapters.sglang.storage import stepped  # noqa: E402
from kvcert.conformance.certification.certify import certify  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("factory", nargs="?", default="factory_storage")
    ap.add_argument("--examples", type=int, default=60)
    opts = ap.parse_args()
    counts: collections.Counter[str] = collections.Counter()
    limited = cc.HiCacheController.prefetch_rate_limited

    def count_limit(self: Any) -> bool:
        out = bool(limited(self))
        counts["admission: declined" if out else "admission: admitted"] += 1
        return out

    check = stepped.SteppedStorage.check

    def count_end(self: Any, pid: int) -> Optional[int]:
        p = self.prefetches[pid]
        requested, fetched, failed = self.progress(pid)
        reading = p.transfer is not None and not p.transfer.done
        out = check(self, pid)
        if out is not None:
            counts["ended"] += 1
            counts["ended mid-batch, keeping nothing"] += int(reading and fetched == 0)
            counts["ended after a miss, keeping the pages before it"] += int(failed and fetched > 0)
        return out

    cc.HiCacheController.prefetch_rate_limited = count_limit  # type: ignore[method-assign]
    stepped.SteppedStorage.check = count_end  # type: ignore[method-assign]
    cert = certify(
        f"kvcert.conformance.adapters.sglang.hicache_backend:{opts.factory}",
        examples=opts.examples,
        seed=0,
        device_cells=False,
        host_cells=False,
    )
    print(f"{opts.factory}: {sum(c.steps for c in cert.cells)} steps, {'passed' if cert.passed else 'failed'}")
    for name in sorted(counts):
        print(f"  {name}: {counts[name]}")


if __name__ == "__main__":
    main()
