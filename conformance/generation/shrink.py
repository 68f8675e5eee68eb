"""Shrinking a failing trace: delete and simplify operations while the same rule still breaks.

Hypothesis finds failures; shrinking happens here, on the trace as data, because
replaying a list of ops is far cheaper than re-running the state machine's
choice sequence, and because a trace's handles are op positions (spec/ops.py):
deleting op i drops the ops that used its handle and renumbers later ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace
from typing import Any, Optional, cast

from kvcert.spec.ops import OP_TYPES, Evict, EvictHost, Insert, Match, Op, Publish

BY_HANDLE = tuple(t for t in OP_TYPES.values() if any(f.name == "handle" for f in fields(t)))
"""Ops that name an earlier op by position (its node, or its match's host node): every op with a
`handle` field, derived from the vocabulary so that a new one (RegisterRef was once missed) is renumbered too."""

Verdict = Callable[[list[Op]], Optional[list[str]]]
"""Replays a trace; returns the broken invariant IDs in report order, or None if it passes."""


def without(ops: list[Op], i: int) -> list[Op]:
    """`ops` minus op i, and minus the ops that named it by position; later positions renumbered."""
    out: list[Op] = []
    for j, op in enumerate(ops):
        if j == i:
            continue
        handle = getattr(op, "handle", None) if isinstance(op, BY_HANDLE) else None
        if isinstance(handle, int) and not isinstance(handle, bool):
            if handle == i:
                continue
            if handle > i:
                op = replace(cast(Any, op), handle=handle - 1)
        out.append(op)
    return out


def simpler(op: Op, page_size: int) -> Iterator[Op]:
    """Smaller versions of one op, most aggressive first."""
    if isinstance(op, Insert):
        if op.namespace is not None:
            yield replace(op, namespace=None)
        if op.priority:
            yield replace(op, priority=0)
        if len(op.tokens) >= page_size:
            shorter = op.tokens[:-page_size]
            value_len = None if op.value_len is None else max(0, op.value_len - page_size)
            yield replace(op, tokens=shorter, value_len=value_len)
    elif isinstance(op, Match):
        if op.namespace is not None:
            yield replace(op, namespace=None)
        if op.tokens:
            yield replace(op, tokens=op.tokens[:-1])
    elif isinstance(op, Publish) and len(op.tokens) >= page_size:
        yield replace(op, tokens=op.tokens[:-page_size])
    elif isinstance(op, (Evict, EvictHost)) and isinstance(op.n, int) and not isinstance(op.n, bool) and op.n > 0:
        yield from (replace(op, n=n) for n in sorted({0, op.n // 2, op.n - 1}) if n < op.n)


@dataclass(frozen=True)
class Shrunk:
    """A shrink's result: the smallest failing trace found, and why it is no smaller where that is not obvious."""

    ops: list[Op]
    note: str = ""
    """"" when shrinking reached a fixpoint (no single deletion or simplification keeps the failure); else why
    the trace came back as it is: it did not fail again, or the replay budget ran out."""


def shrink(ops: list[Op], verdict: Verdict, page_size: int, budget: int = 3000) -> Shrunk:
    """Greedy one-at-a-time deletion, then simplification, to a fixpoint or `budget` replays."""
    first = verdict(ops)
    if not first:
        return Shrunk(
            ops,
            "not shrunk: the trace as found does not fail again when replayed on a fresh backend as valid traffic "
            "(it passes, no caller could play it, or it fails only after an op the oracle rejects as bad input)",
        )
    target = first[0]
    replays = 0

    def keeps_failing(candidate: list[Op]) -> bool:
        nonlocal replays
        replays += 1
        got = verdict(candidate)
        return got is not None and target in got

    changed = True
    while changed and replays < budget:
        changed = False
        i = len(ops) - 1
        while i >= 0 and replays < budget:
            candidate = without(ops, i)
            if keeps_failing(candidate):
                ops, changed = candidate, True
            i = min(i, len(ops)) - 1
        for i in range(len(ops)):
            for smaller in simpler(ops[i], page_size):
                if replays >= budget:
                    break
                candidate = ops[:i] + [smaller] + ops[i + 1 :]
                if keeps_failing(candidate):
                    ops, changed = candidate, True
                    break
    note = f"shrinking stopped at its budget of {budget} replays: a smaller trace may exist" if changed else ""
    return Shrunk(ops, note)
