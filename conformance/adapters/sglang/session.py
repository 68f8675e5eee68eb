"""SGLang 0.5.23's session-ref `UnifiedRadixCache` (`--enable-session-radix-cache`) against SPEC.md §11.

    KVCERT_SGLANG=1 .venv/bin/kvcert certify kvcert.conformance.adapters.sglang.session:factory
    KVCERT_SGLANG=1 .venv/bin/kvcert certify kvcert.conformance.adapters.sglang.session:factory_rust
    (and :factory_planned, :factory_rust_planned, :factory_planned_moves: with SPEC.md §11.5 run by kvcert; below)

A subclass of the HiCache adapter (`sglang_hicache_backend.SGLangHiCacheBackend`, over the deterministic
CPU driver `sglang_hicache.SGLangHiCache`): the same cache, pools, copies, locks, KV reads and snapshot,
built with `CacheInitParams(enable_session_radix_cache=True)` (the driver builds its params itself; the
adapter supplies the flag by wrapping `CacheInitParams` while the driver runs its constructor, and
restores it after). `host_capacity == 0` builds a device-only cache; host-tier cells run HiCache with
session refs (SGLang allows the two together). No input checking (`strict_input=False`).

Tree cores. SGLang 0.5.23's Rust core has no session refs: `RustTreeCore.__init__` raises on the flag
(`rust_tree_core/adapter.py:384-388`), and `resolve_tree_core_backend` turns a "rust" selection with the
flag into the Python core (`unified_cache/tree_core_registry.py:44-46`, `:115-120`, logged "Using the
Python TreeCore: session-aware caching requires the Python TreeCore"). `factory_rust` asks for the Rust
core as a deployment with the default backend does and certifies what SGLang then builds: the Python core
(asserted at construction; its capabilities' name says so). docs/calibration/session.md S1.

Mapping (SPEC.md §11 onto SGLang's own calls; docs/calibration/session.md has every difference):

* `register_ref(session, node, priority)`: what the scheduler does for a radix-native session request.
  At its arrival `req.session_generation = cache.ensure_session_generation(session)` (scheduler.py:3036,
  :3082; opens the session, clearing a close tombstone, when it has no generation); at its finish
  `cache.session_refs.register_session_ref(req, leaf)` with the node its insert ended on
  (unified_radix_cache.py:1329-1335, `checkpoint_into_tree`). The kvcert op is one request that arrives
  and finishes at once, so its generation is always current (generation fencing never fires: S7).
  `priority` goes nowhere: the engine has no session priority.
* `update_ref(session, priority)`: the engine has no call; nothing reaches SGLang. The adapter records the
  priority (for the snapshot's classes) of a session SGLang has open (`_session_generations`), and
  raises `UnknownSession` for one it has not (reading SGLang's state, not judging the call).
* `release_ref(session)`: `cache.release_radix_session(session)` (the scheduler's `close_session`,
  scheduler.py:6150-6153).
* `evict(n, allow_low, allow_high)`: SGLang's plain `evict(n)`, whatever the scope: the engine has no
  scoped eviction (S3). Its victims rank `(session_ref > 0, session_ref, LRU)` (components/full.py:205-207).
* `evict_host(n)`: SGLang's `evict_host(n)`, the same rank over host leaves (full.py:250-280); no demotion.
* `plan_admission`: the engine has none (its scheduler admits against `available + evictable`, with no
  session tiers). `factory` / `factory_rust` raise `NotImplementedError` (an untyped error: INV-ERR-3, S9);
  `factory_planned` / `factory_rust_planned` run SPEC.md §11.5 (`kvcert.spec.admission`) over SGLang's own
  counters so that generation gets past admission to the session refs. Their admission verdicts judge
  kvcert's planner, not SGLang, and their names say so.
* `factory_planned_moves`: as `factory_planned`, except that registering a session SGLang has open first
  closes it (`release_radix_session`), so the next request reopens it (`ensure_session_generation` finds no
  generation, `open_radix_session` clears the tombstone): the composition a scheduler on SGLang has to move
  a session to a new path (S4, S5), which gets generation past re-registration to what follows it.

Priority classes. SGLang keeps one class of session ref: one counter per node, `session_ref`, the number
of (session, frontier leaf) pairs whose path holds the node (full.py:68-108), and eviction ranks by it
alone. §11 has two. The adapter keeps each session's priority as the scheduler passed it and reports the
spec's class for it (high when `priority >= H`; never demoted: SGLang has no demotion), and splits SGLang's
one counter by those classes: a node's `high_ref` is the number of (high session, leaf) pairs SGLang
indexes at or below it (`FullComponent._session_leaves`), its `low_ref` SGLang's `session_ref` minus that.
So the two counters always sum to SGLang's own, and every difference from §11 shows in behaviour (what is
evicted, in which order, in which scope), not in the labels. With every session of one class, SGLang's
rank is §11.3's `(tier, high_ref, low_ref, LRU)` exactly (S2).

Snapshot (beyond the HiCache adapter's): the sessions SGLang has open (`_session_generations`), in the order
of the adapter's own (re)registrations (SGLang keeps a session's first-open order and reads no order), each
ending at the deepest frontier leaf SGLang indexes for it (ties: the lower id; none: the root);
`tier_evictable` from the node walk (SGLang keeps no per-tier counters, so INV-TIER-2 checks this file's
arithmetic against SGLang's `evictable_size`: S10).

Determinism: as the HiCache adapter's (node ids, access stamps, uuids and op ids from per-driver counters;
the evictable leaf sets insertion-ordered). SGLang's session state adds sets hashed by address or by
`PYTHONHASHSEED` (`_session_leaves[sid]`, `ComponentData.session_ids`); they are only iterated to add or
subtract one per node, where order changes nothing, and the adapter reads them sorted.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, Optional

from kvcert.conformance.adapters.sglang import hicache as _driver
from kvcert.conformance.adapters.sglang.env import SGLANG_VERSION
from kvcert.conformance.adapters.sglang.hicache_backend import SGLangHiCacheBackend
from kvcert.conformance.adapters.sglang.hicache_backend import factory as _hicache_factory
from kvcert.spec.types import (
    AdmissionPlan,
    AdmissionProfile,
    CacheConfig,
    Capabilities,
    Running,
    SessionView,
    Snapshot,
    UnknownSession,
    tier_of,
)

__all__ = [
    "SGLangSessionBackend",
    "factory",
    "factory_planned",
    "factory_planned_moves",
    "factory_rust",
    "factory_rust_planned",
]

FULL = _driver.FULL

from sglang.srt.mem_cache.unified_cache import tree_core_registry as _registry  # noqa: E402  (after the shims)


@contextlib.contextmanager
def _session_params(tree_core_backend: str) -> Iterator[None]:
    """While the driver builds its cache: its `CacheInitParams` get the session flag and the asked-for core."""
    real = _driver.SG.CacheInitParams

    def params(**kwargs: Any) -> Any:
        kwargs["enable_session_radix_cache"] = True  # --enable-session-radix-cache (kv_cache_builder.py:412)
        kwargs["tree_core_backend"] = tree_core_backend
        return real(**kwargs)

    _driver.SG.CacheInitParams = params
    try:
        yield
    finally:
        _driver.SG.CacheInitParams = real


class SGLangSessionBackend(SGLangHiCacheBackend):
    """One session-ref UnifiedRadixCache (+ HiCache when host_capacity > 0); node handles are SGLang NodeIds."""

    def __init__(
        self,
        config: CacheConfig,
        requested_core: str = "python",
        planned: bool = False,
        moves: bool = False,
        kv_events: bool = False,
    ) -> None:
        with _session_params(requested_core):
            # core="python": what SGLang builds with sessions on, whichever core was asked for (S1).
            super().__init__(config, core="python", kv_events=kv_events)
        cache = self.h.cache
        assert cache.enable_session_radix_cache and cache.session_refs.enable_session_radix_cache
        assert type(cache.tree_core).__name__ == "UnifiedTreeCore", type(cache.tree_core).__name__
        self.requested_core = requested_core
        self.fallback = _registry._rust_fallback_reason(self.h.params) if requested_core == "rust" else None
        """Why SGLang built the Python core for a "rust" selection (S1)."""
        assert requested_core == "python" or self.fallback, "SGLang would have built the Rust core"
        (self._full,) = [c for c in cache.tree_core.components if c.component_type == FULL]
        self.planned = planned
        self.moves = moves
        """Registering an open session first closes it (`factory_planned_moves`)."""
        self._priority: dict[str, int] = {}
        """Session -> the priority the scheduler gave it last, in (re)registration order (SGLang keeps none)."""

    # ------------------------------------------------------------------ SPEC.md §11 on SGLang's calls

    def register_ref(self, session: str, node: int, priority: int) -> None:
        self._live(node)
        cache = self.h.cache
        with self.h._in_sglang():
            if self.moves and session in cache.session_refs._session_generations:
                cache.release_radix_session(session)  # close_session (scheduler.py:6150-6153)
            # The request arrives (scheduler.py:3036 / :3082) ...
            generation = cache.ensure_session_generation(session)
            req = types.SimpleNamespace(session_id=session, session=None, session_generation=generation)
            # ... and finishes, its insert ending at `node` (unified_radix_cache.py:1329-1335).
            cache.session_refs.register_session_ref(req, leaf=node)
        self._priority.pop(session, None)
        self._priority[session] = priority

    def update_ref(self, session: str, priority: int) -> None:
        """No SGLang call: the engine has no session priority (S2). Recorded for the snapshot's classes."""
        if session not in self.h.cache.session_refs._session_generations:
            raise UnknownSession(f"SGLang has no open session {session!r}")
        self._priority[session] = priority

    def release_ref(self, session: str) -> None:
        with self.h._in_sglang():
            self.h.cache.release_radix_session(session)  # an unknown or closed id returns 0, no error (S6)
        self._priority.pop(session, None)

    def evict(self, n: int, allow_low: bool = True, allow_high: bool = True) -> int:  # type: ignore[override]
        """SGLang's only device eviction, whatever the scope (S3)."""
        return self.h.evict(n)

    def plan_admission(
        self, tokens: int, priority: int, running: Sequence[Running], profile: Optional[AdmissionProfile]
    ) -> AdmissionPlan:
        if not self.planned:
            raise NotImplementedError(
                "SGLang 0.5.23's UnifiedRadixCache plans no admission (docs/calibration/session.md S9)"
            )
        from kvcert.spec.admission import AdmissionCounters, plan_admission

        snap = self.snapshot()
        assert snap.tier_evictable is not None
        counters = AdmissionCounters(
            page_size=self.page_size,
            layers=self.config.kv_layers,
            high_threshold=self.config.high_priority_threshold,
            free=len(snap.free_slots),
            evictable=int(self.h.cache.evictable_size()),
            held_high=snap.tier_evictable[2],
            host_free=len(snap.host_free_slots),
        )
        return plan_admission(counters, tokens, priority, running, profile)

    # ------------------------------------------------------------------ observation

    def _is_high(self, session: str) -> bool:
        return self._priority.get(session, 0) >= self.config.high_priority_threshold

    def _open_sessions(self) -> list[str]:
        """SGLang's open sessions, in the adapter's (re)registration order (SGLang's own order is first-open)."""
        gens = self.h.cache.session_refs._session_generations
        return [s for s in self._priority if s in gens] + sorted(s for s in gens if s not in self._priority)

    def snapshot(self) -> Snapshot:
        base = super().snapshot()
        core = self.h.cache.tree_core
        parent = {v.id: v.parent for v in base.nodes}
        depth: dict[int, int] = {}

        def depth_of(nid: int) -> int:
            if nid not in depth:
                p = parent[nid]
                depth[nid] = 0 if p is None else depth_of(p) + 1
            return depth[nid]

        high: dict[int, int] = {}
        sessions = []
        for sid in self._open_sessions():
            leaves = sorted(int(leaf.id) for leaf in self._full._session_leaves.get(sid, ()))
            if self._is_high(sid):
                for leaf in leaves:
                    cur: Optional[int] = leaf
                    while cur is not None and cur != base.root:
                        high[cur] = high.get(cur, 0) + 1
                        cur = parent.get(cur)
            end = max(leaves, key=lambda i: (depth_of(i), -i)) if leaves else base.root
            priority = self._priority.get(sid, 0)
            sessions.append(SessionView(id=sid, node=end, priority=priority, high=self._is_high(sid)))
        nodes = []
        tiers = [0, 0, 0]
        for v in base.nodes:
            if v.parent is None:
                nodes.append(v)
                continue
            total = int(core.node_by_id(v.id).component_data[FULL].session_ref)
            h = high.get(v.id, 0)
            view = replace(v, high_ref=h, low_ref=total - h)
            nodes.append(view)
            if view.slots is not None and view.lock_ref == 0:
                tiers[tier_of(view.high_ref, view.low_ref)] += len(view.key)
        return replace(
            base,
            nodes=tuple(nodes),
            sessions=tuple(sessions),
            tier_evictable=(tiers[0], tiers[1], tiers[2]),
            high_priority_threshold=self.config.high_priority_threshold,
        )


def _make(requested_core: str, planned: bool, moves: bool = False) -> Any:
    def factory(config: CacheConfig) -> SGLangSessionBackend:
        return SGLangSessionBackend(config, requested_core=requested_core, planned=planned, moves=moves)

    name = (
        "factory"
        + ("_rust" if requested_core == "rust" else "")
        + ("_planned" if planned else "")
        + ("_moves" if moves else "")
    )
    factory.__name__ = factory.__qualname__ = name
    core = (
        "rust tree core asked, Python core built by SGLang's fallback (sessions need it)"
        if requested_core == "rust"
        else "python tree core"
    )
    base: Capabilities = _hicache_factory.capabilities  # type: ignore[attr-defined]
    factory.capabilities = replace(  # type: ignore[attr-defined]
        base,
        name=f"sglang.UnifiedRadixCache session refs {SGLANG_VERSION} ({core}, layer_first"
        + (", admission planned by kvcert" if planned else "")
        + (", re-register = close + reopen" if moves else "")
        + ")",
        priority_refs=True,
        # One ref class, no scoped eviction, no update_ref; admission only where kvcert plans it (S2, S3, S9);
        # moves only where the adapter composes one (S4: SGLang's registration adds a frontier path, it does not
        # move the session): the suite sends none of the rest, and the certificate lists each as not declared.
        priority_parts=(("scope", "admission") if planned else ()) + (("move",) if moves else ()),
        reports_metadata=True,
        notes=base.notes[:2]
        + (
            "CacheInitParams(enable_session_radix_cache=True); snapshots read off the Python node objects",
            f"{core}: rust_tree_core/adapter.py:384-388, tree_core_registry.py:44-46",
            "register_ref = ensure_session_generation at arrival + session_refs.register_session_ref(req, leaf) at "
            "finish; release_ref = release_radix_session; update_ref = no SGLang call (no session priority)",
            "one class of session ref: high_ref/low_ref split SGLang's session_ref by the priority the scheduler "
            "passed; evict(n, scope) = SGLang's plain evict (no scoped eviction); no demotion",
            (
                "plan_admission: SPEC.md §11.5 (kvcert.spec.admission) over SGLang's counters: kvcert's planner, "
                "not SGLang's"
                if planned
                else "plan_admission: SGLang has none; the call raises NotImplementedError"
            ),
        )
        + (
            ("register_ref of an open session: release_radix_session first (close, then a new request reopens)",)
            if moves
            else ()
        ),
        deviations=base.deviations
        + (
            "register_ref: the adapter composes the scheduler's two calls (ensure_session_generation, then "
            "register_session_ref with the node it names) around one request that arrives and finishes at once, "
            "so generation fencing never fires (S7)",
        )
        + (("plan_admission: kvcert's planner over SGLang's counters; SGLang has none",) if planned else ())
        + (
            (
                "a registered session registered again is closed first, then reopened: SGLang's own re-registration "
                "(which adds a frontier leaf: S4, S5) is not run",
            )
            if moves
            else ()
        ),
    )
    factory.__doc__ = f"SGLang {SGLANG_VERSION} session-ref UnifiedRadixCache, {core}" + (
        "; admission planned by kvcert (SPEC.md §11.5 over SGLang's counters)." if planned else "."
    )
    return factory


factory = _make("python", planned=False)
"""`kvcert certify kvcert.conformance.adapters.sglang.session:factory`: Python core, faithful (no planner)."""
factory_rust = _make("rust", planned=False)
"""`...:factory_rust`: the Rust core asked for; SGLang builds the Python core (S1)."""
factory_planned = _make("python", planned=True)
"""`...:factory_planned`: as `factory`, with kvcert's §11.5 planner over SGLang's counters (past S9)."""
factory_rust_planned = _make("rust", planned=True)
"""`...:factory_rust_planned`: as `factory_rust`, with kvcert's §11.5 planner."""
factory_planned_moves = _make("python", planned=True, moves=True)
"""`...:factory_planned_moves`: as `factory_planned`, a re-registration composed as close + reopen (past S4, S5)."""
factory_moves = _make("python", planned=False, moves=True)
"""`...:factory_moves`: as `factory`, a re-registration composed as close + reopen (past S4, S5): what the
engine offers, used as a scheduler on it must move a session."""
