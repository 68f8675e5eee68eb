"""Admission plans (SPEC.md §11.5, §11.6) as a pure function of a few counters and the request.

§11.5 asks for a plan that admits when free slots and in-scope evictable tokens cover the request, and
otherwise, for a high-priority request, retracts the fewest low-priority ones that close the shortfall; §11.6 lets
it keep fewer layers.
This module states that as code over an `AdmissionCounters` record (free slots of both allocators,
`evictable_size`, the HIGH_REF tier's evictable tokens): no tree access, nothing changed, O(L + r log r)
for `L` layers and `r` running requests. `kvcert.gpu` plans with it, and so do the adapters of engines with
no planner of their own; the reference model plans from its own state, independently, and the suite compares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from kvcert.spec import pages
from kvcert.spec.types import AdmissionPlan, AdmissionProfile, InvalidPlan, Running, check_priority


@dataclass(frozen=True)
class AdmissionCounters:
    """What a plan reads of a cache, as of one moment."""

    page_size: int
    layers: int
    """`CacheConfig.kv_layers`: a request resident in all of them needs all its tokens (§11.6)."""
    high_threshold: int
    free: int
    """Free device slots (torn pages' free slots included)."""
    evictable: int
    """Device tokens of unlocked nodes, every tier (`evictable_size`)."""
    held_high: int
    """Of those, the HIGH_REF tier's: out of a low-priority request's scope."""
    host_free: int
    """Free host slots (0 without a host tier): where retracted requests' KV can be kept."""


def _is_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_count(x: object) -> bool:
    return _is_id(x) and x >= 0  # type: ignore[operator]


def fewest_covering(low: Sequence[Running], short: int) -> Optional[list[Running]]:
    """SPEC.md §11.5's retraction: the fewest requests freeing `short` tokens, None if all of them cannot.

    With `k` the fewest that can cover `short`, the first `k - 1` picks are the largest (tokens
    descending, then id ascending); the last is the smallest request left (tokens ascending, then id
    ascending) that closes the gap. O(r log r).
    """
    by_size = sorted(low, key=lambda r: (-r.tokens, r.id))
    k = covered = 0
    while k < len(by_size) and covered < short:
        covered += by_size[k].tokens
        k += 1
    if covered < short or not k:
        return None
    gap = short - (covered - by_size[k - 1].tokens)  # what the last pick must free
    last = min((r for r in by_size[k - 1 :] if r.tokens >= gap), key=lambda r: (r.tokens, r.id))
    return [*by_size[: k - 1], last]


def check_request(tokens: object, priority: object, running: object, profile: object) -> None:
    """`InvalidPlan` (or `InvalidCount` for the priority) for a malformed request, in the protocol's order."""
    if not _is_count(tokens):
        raise InvalidPlan(f"a request needs a non-negative int of tokens, got {tokens!r}")
    check_priority(priority)
    if not isinstance(running, Sequence) or not all(
        isinstance(r, Running) and _is_count(r.id) and _is_count(r.tokens) and _is_id(r.priority) for r in running
    ):
        raise InvalidPlan(f"running requests must be Running(id, priority, tokens) of ints, got {running!r}")
    if len({r.id for r in running}) != len(running):
        raise InvalidPlan("running request ids repeat")
    if profile is not None and not (
        isinstance(profile, AdmissionProfile)
        and _is_count(profile.load)
        and _is_count(profile.store)
        and _is_count(profile.step)
        and _is_count(profile.target)
    ):
        raise InvalidPlan(f"a profile holds non-negative ints, got {profile!r}")


def plan_admission(
    c: AdmissionCounters,
    tokens: int,
    priority: int,
    running: Sequence[Running],
    profile: Optional[AdmissionProfile],
) -> AdmissionPlan:
    """What admitting a request of `tokens` new device tokens at `priority` takes, given counters `c`.

    Checks the request first (`check_request`). Fewer resident layers are tried only with a profile
    that keeps the streaming cost within its target; a high-priority request may retract low ones.
    """
    check_request(tokens, priority, running, profile)
    ps, total = c.page_size, c.layers
    high = priority >= c.high_threshold
    free = c.free
    scope = c.evictable - (0 if high else c.held_high)  # UNUSED + LOW_REF (+ HIGH_REF)
    low = [r for r in running if r.priority < c.high_threshold]  # a high-priority request is never retracted
    for layers in range(total, 0, -1):
        if layers < total and (
            profile is None
            or profile.step + (total - layers) * tokens * (profile.load + profile.store) > profile.target
        ):
            break  # fewer resident layers stream more: past the first refusal none is admitted (§11.6)
        need = pages.page_ceil(-(-tokens * layers // total), ps)
        if free + scope >= need:
            return AdmissionPlan(True, max(0, need - free), high, (), (), layers, need)
        if not high:
            continue
        picks = fewest_covering(low, need - free - scope)
        if picks is None:
            continue
        keep: list[bool] = []
        room = c.host_free
        for r in picks:
            size = pages.page_ceil(r.tokens, ps)
            fits = 0 < size <= room
            keep.append(fits)
            if fits:
                room -= size
        return AdmissionPlan(True, scope, True, tuple(r.id for r in picks), tuple(keep), layers, need)
    return AdmissionPlan(False, allow_high=high)
