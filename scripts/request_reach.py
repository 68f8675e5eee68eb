"""How often a request-path certification of SGLang reaches rare states: retraction, and each kind of KV event.

    KVCERT_SGLANG=1 .venv/bin/python scripts/request_reach.py factory_engine_ids --examples 200

Counts SGLang's own `ScheduleBatch.retract_decode` calls, and the requests they retracted, and the KV events its
recorder published by kind and medium (a host removal is a host eviction), over every cell of
`sglang_requests:<factory>` (seed 0, 50 steps an example). The counters wrap the engine's methods; nothing else
changes.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from kvcert.conformance.adapters.sglang import requests as sglang_requests  # noqa: F401  (SGLang's CPU import shims first)
from kvcert.conformance.certification.certify import certify


def main() -> None:
    from sglang.srt.managers import schedule_batch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("factory", nargs="?", default="factory_engine_ids")
    ap.add_argument("--examples", type=int, default=200)
    opts = ap.parse_args()
    calls, requests = [0], [0]
    retract = schedule_batch.ScheduleBatch.retract_decode

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = retract(self, *args, **kwargs)
        calls[0] += 1
        requests[0] += len(out[0])
        return out

    schedule_batch.ScheduleBatch.retract_decode = counting  # type: ignore[method-assign]
    events = _count_events()
    cert = certify(f"kvcert.conformance.adapters.sglang.requests:{opts.factory}", examples=opts.examples, seed=0)
    print(f"{opts.factory}: {sum(c.steps for c in cert.cells)} steps, {'passed' if cert.passed else 'failed'}")
    print(f"  retract_decode calls: {calls[0]}, requests retracted: {requests[0]}")
    print("  KV events recorded: " + ", ".join(f"{kind} {medium} {n}" for (kind, medium), n in sorted(events.items())))


def _count_events() -> Counter[tuple[str, str]]:
    """Wrap SGLang's recorder: each store and removal it records, by medium (GPU when none is named)."""
    from sglang.srt.mem_cache.events import KVCacheEventRecorder

    seen: Counter[tuple[str, str]] = Counter()
    for kind in ("store", "remove"):
        original = getattr(KVCacheEventRecorder, f"record_{kind}")

        def counting(self: Any, node: Any, medium: Any = None, *, _o: Any = original, _k: str = kind, **kw: Any) -> Any:
            if self.enabled:
                seen[_k, str(getattr(medium, "value", medium or "GPU"))] += 1
            return _o(self, node, medium, **kw)

        setattr(KVCacheEventRecorder, f"record_{kind}", counting)
    return seen


if __name__ == "__main__":
    main()
