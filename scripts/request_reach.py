"""How often a request-path certification of SGLang makes its scheduler retract a running request.

    KVCERT_SGLANG=1 .venv/bin/python scripts/request_reach.py factory_engine_ids --examples 200

Counts SGLang's own `ScheduleBatch.retract_decode` calls, and the requests they retracted, over every cell of
`sglang_requests:<factory>` (seed 0, 50 steps an example). The counter wraps the engine's method; nothing else
changes.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvcert.conformance.adapters import sglang_requests  # noqa: F401  (SGLang's CPU import shims first)
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
    cert = certify(f"kvcert.conformance.adapters.sglang_requests:{opts.factory}", examples=opts.examples, seed=0)
    print(f"{opts.factory}: {sum(c.steps for c in cert.cells)} steps, {'passed' if cert.passed else 'failed'}")
    print(f"  retract_decode calls: {calls[0]}, requests retracted: {requests[0]}")


if __name__ == "__main__":
    main()
