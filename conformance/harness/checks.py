"""The checks: after every step, the backend's state and answer against the spec and the oracle.

Three families, in the order a step reports them: the operation's contract (`contract`: its answer
against the oracle's, the relations SPEC.md states over the snapshots before and after), the state
invariants of the backend's snapshot (`spec.invariants.check_snapshot`), and the state against the
oracle's (`state`: tree shape and residency, locks, copies, prefetches, sessions, retraction
backups, the L3 store, and every KV byte on both tiers, `kv`). Every derived structure they use
(paths, shapes, page slots) is computed once per snapshot (`Snapshot.derived`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from kvcert.conformance.backend import Backend
from kvcert.conformance.harness.ledger import Ledger
from kvcert.conformance.harness.scheduler import Outcome, running_of
from kvcert.conformance.harness.side import KVModel
from kvcert.conformance.harness.steering import path_order
from kvcert.conformance.harness.storage import FaultyStorage
from kvcert.refimpl import RefCache
from kvcert.spec import contracts, pages
from kvcert.spec.invariants import Violation, check_snapshot
from kvcert.spec.ops import (
    Admit,
    Checkpoint,
    CheckPrefetch,
    Evict,
    EvictHost,
    Extend,
    Finish,
    Insert,
    LoadBack,
    Match,
    Op,
    Poll,
    Prefetch,
    Restore,
    Retract,
    Start,
)
from kvcert.spec.page_table import CachedPage, PageTable
from kvcert.spec.profiles import RANK, profile
from kvcert.spec.types import (
    AdmissionPlan,
    AdmissionProfile,
    CacheConfig,
    Capabilities,
    InsertOut,
    KVCertError,
    MatchOut,
    Snapshot,
)


@dataclass
class Checks:
    """Every rule a step is judged by, for one backend under one config."""

    backend: Backend
    config: CacheConfig
    capabilities: Capabilities
    ledger: Ledger
    model: KVModel
    load_host_lock: bool = True
    """Whether a pending load must host-lock its node: the profile pins LOAD_LOCK (SPEC.md §6.1)."""
    kv_entries_read: int = 0
    """KV entries read back from the backend and compared so far (the certificate counts KV as exercised by it)."""

    def contract(
        self,
        op: Op,
        before: Snapshot,
        after: Snapshot,
        got: Outcome,
        want: Outcome,
        out: list[Violation],
        planned: Optional[Snapshot] = None,
        inserted: Optional[tuple[Any, tuple[Any, ...]]] = None,
    ) -> None:
        """The operation's contract, and the backend's answer against the oracle's. A running request's
        `Start` is held to the match contract, its checkpoint to the insert contract on the key it
        `inserted` (SPEC.md §4.8)."""
        if isinstance(want, KVCertError) or isinstance(got, KVCertError):
            if not isinstance(got, KVCertError):
                out.append(Violation("INV-ERR-1", f"succeeded; the spec raises {type(want).__name__}: {want}"))
            elif not isinstance(want, KVCertError):
                out.append(Violation("INV-ERR-2", f"rejected a valid call with {type(got).__name__}: {got}"))
            elif type(got) is not type(want):
                out.append(Violation("INV-ERR-1", f"raised {type(got).__name__}, the spec says {type(want).__name__}"))
            composite = isinstance(op, (Start, Extend, Checkpoint, Finish))  # calls before the rejected one stand
            if isinstance(got, KVCertError) and not composite and not same_state(before, after):
                out.append(Violation("INV-ERR-1", f"{type(got).__name__} was raised but the state changed"))
            return
        out += [Violation("INV-SLOT-3", m) for m in contracts.slot_changes(before, after)]
        if isinstance(op, Match) and isinstance(got, MatchOut):
            self.match(op, before, after, got, out)
        if isinstance(op, Insert) and isinstance(got, InsertOut) and isinstance(want, InsertOut):
            self.insert(op, before, after, got, out)
        if isinstance(op, Start) and isinstance(got, MatchOut):
            self.match(Match(op.namespace, op.tokens), before, after, got, out)
        if isinstance(op, (Checkpoint, Finish)) and isinstance(got, InsertOut) and inserted is not None:
            self.insert(Insert(*inserted), before, after, got, out)
        if isinstance(op, Evict) and got != want:
            out.append(Violation("INV-EVICT-5", f"freed {got}, the oracle (same victims) freed {want}"))
        if self.capabilities.priority_refs and isinstance(op, Evict):
            scope = (op.allow_low, op.allow_high)
            out += [Violation(i, m) for i, m in contracts.tier_eviction_violations(before, after, *scope)]
        if isinstance(op, Admit) and isinstance(got, AdmissionPlan) and planned is not None:
            out += [
                Violation(i, m)
                for i, m in contracts.plan_violations(
                    planned,
                    op.length,
                    op.priority,
                    running_of(op.running),
                    AdmissionProfile(*op.profile) if op.profile is not None else None,
                    self.config.kv_layers,
                    got,
                    self.capabilities.retraction,
                )
            ]
            if got != want:
                out.append(Violation("INV-ADMIT-4", f"plan {got}, the spec's {want}"))
        if self.capabilities.priority_refs and isinstance(op, EvictHost):
            out += [Violation(i, m) for i, m in contracts.host_tier_violations(before, after)]
        if isinstance(op, EvictHost) and got != want:
            out.append(Violation("INV-HOST-8", f"freed {got} host tokens, the oracle (same victims) freed {want}"))
        if isinstance(op, LoadBack) and got != want:
            out.append(Violation("INV-LOAD-1", f"loaded back {got} tokens, the spec loads {want}"))
        if isinstance(op, Poll) and got != want:
            out.append(
                Violation("INV-COPY-2", f"consumed {got} acks, the spec consumes {want} (finished, in issue order)")
            )
        if isinstance(op, Prefetch) and got != want:
            out.append(Violation("INV-PF-2", f"prefetch asked storage for {got} tokens, the spec asks {want}"))
        if isinstance(op, Retract) and (got is None) != (want is None):
            out.append(
                Violation(
                    "INV-RETRACT-2",
                    f"retraction backup {'declined' if got is None else 'made'}; the spec "
                    f"{'declines it' if want is None else 'makes it'}",
                )
            )
        if isinstance(op, Restore) and isinstance(got, int):
            self.handle(after, got, None, (), out)  # the root: the resumed request's last node
        if isinstance(op, CheckPrefetch) and got != want:
            say = {None: "kept it running"}
            out.append(
                Violation(
                    "INV-PF-3",
                    f"check_prefetch {say.get(got, f'ended it adding {got} tokens')}; "  # type: ignore[arg-type]
                    f"the spec {say.get(want, f'ends it adding {want} tokens')}",  # type: ignore[arg-type]
                )
            )

    def handle(self, after: Snapshot, node: int, namespace: Any, tokens: tuple, out: list[Violation]) -> None:
        ids = after.by_id()
        if node not in ids:
            out.append(Violation("INV-HANDLE-1", f"returned node {node} is not in the tree"))
            return
        ns, path = after.path_of(node)
        if path != tokens:
            out.append(Violation("INV-HANDLE-1", f"returned node ends at {len(path)} tokens, not at {len(tokens)}"))
        elif tokens and ns != namespace:
            out.append(Violation("INV-NS-2", f"returned node is in namespace {ns!r}, asked {namespace!r}"))

    def match(self, op: Match, before: Snapshot, after: Snapshot, got: MatchOut, out: list[Violation]) -> None:
        expect = contracts.cached_prefix_len(before, op.namespace, op.tokens)
        if got.length != expect:
            out.append(Violation("INV-MATCH-1", f"matched {got.length} tokens, {expect} are cached"))
            return
        slots = contracts.prefix_slots(after, op.namespace, op.tokens, got.length)
        if tuple(got.slots) != slots:
            out.append(Violation("INV-MATCH-2", f"returned slots {tuple(got.slots)[:8]}, the tree holds {slots[:8]}"))
        self.handle(after, got.node, op.namespace, tuple(op.tokens[: got.length]), out)
        if self.config.host_capacity:
            expect_host = contracts.host_hit_len(before, op.namespace, op.tokens, got.length)
            if got.host_length != expect_host:
                out.append(
                    Violation("INV-MATCH-3", f"host hit {got.host_length} tokens, {expect_host} are on the host only")
                )

    def insert(self, op: Insert, before: Snapshot, after: Snapshot, got: InsertOut, out: list[Violation]) -> None:
        expect = contracts.cached_prefix_len(before, op.namespace, op.tokens)
        if got.prefix_len != expect:
            out.append(Violation("INV-INS-1", f"insert reported prefix {got.prefix_len}, {expect} was cached"))
            return
        key = tuple(op.tokens)
        if self.capabilities.aligns_keys:  # a key that ends mid-page: its page-aligned head is cached (§4.2)
            key = key[: len(key) - len(key) % self.config.page_size]
        if contracts.cached_prefix_len(after, op.namespace, key) != len(key):
            out.append(Violation("INV-INS-2", "the inserted key is not fully cached afterwards"))
            return
        self.handle(after, got.node, op.namespace, key, out)

    def state(
        self, snap: Snapshot, oracle: RefCache, spec: Snapshot, storages: tuple[FaultyStorage, ...]
    ) -> list[Violation]:
        """State invariants, then shape, locks, copies, prefetches, sessions, backups, storage and KV
        against the oracle (`spec`: its snapshot)."""
        violations = check_snapshot(snap, self.load_host_lock)
        if not any(v.inv == "INV-TREE-1" for v in violations):
            mine, spec_shape = contracts.shape(snap), contracts.shape(spec)
            if mine == spec_shape:  # the spec's tree, node for node (the common case)
                pass
            elif {p: v.size for p, v in mine.items()} != {p: v.size for p, v in spec_shape.items()}:
                extra_paths = sorted(set(mine) - set(spec_shape), key=path_order)[:2]
                missing = sorted(set(spec_shape) - set(mine), key=path_order)[:2]
                violations.append(
                    Violation("INV-TREE-4", f"tree differs from the spec's: extra {extra_paths}, missing {missing}")
                )
            else:
                for p in sorted(mine, key=path_order):
                    inv = contracts.shape_difference(mine[p], spec_shape[p])
                    if inv is not None:
                        violations.append(
                            Violation(inv, f"node at {p[1][-4:]}@{len(p[1])} is {mine[p]}, spec says {spec_shape[p]}")
                        )
                        break
            theirs = [(c.kind, c.finished) for c in oracle.copies]
            if [(c.kind, c.finished) for c in snap.pending] != theirs:
                violations.append(
                    Violation(
                        "INV-COPY-1",
                        f"pending copies {[(c.kind, c.finished) for c in snap.pending]}, spec says {theirs}",
                    )
                )
            else:
                violations += self.copy_contents(snap, oracle, spec)
            mine_pf = [(p.requested, p.fetched, p.failed) for p in snap.prefetches]
            spec_pf = [(p.requested, p.fetched, p.failed) for p in spec.prefetches]
            if mine_pf != spec_pf:
                violations.append(
                    Violation("INV-PF-3", f"prefetches (requested, fetched, failed) {mine_pf}, spec says {spec_pf}")
                )
            mine_ss, spec_ss = contracts.session_paths(snap), contracts.session_paths(spec)
            if mine_ss != spec_ss:
                differ = next((a, b) for a, b in itertools.zip_longest(mine_ss, spec_ss) if a != b)
                violations.append(
                    Violation(
                        "INV-TIER-5", f"session (id, path, priority, high, demoted) {differ[0]}, spec says {differ[1]}"
                    )
                )
            violations += retention_violations(snap, spec)
            mine_rt = [r.tokens for r in snap.retractions]
            spec_rt = [r.tokens for r in oracle.retractions]
            if mine_rt != spec_rt:
                violations.append(
                    Violation("INV-RETRACT-2", f"retraction backups (tokens) {mine_rt}, spec says {spec_rt}")
                )
            violations += self.storage(storages)
            violations += self.kv(snap)
            violations += self.rows(snap)
            violations += self.metadata(snap, oracle, spec)
        return violations

    def metadata(self, snap: Snapshot, oracle: RefCache, spec: Snapshot) -> list[Violation]:
        """INV-META-1 (a profile that pins RANK): the eviction order the backend's metadata gives its nodes under the
        cell's policy refines the order the spec's metadata updates give them (SPEC.md §4.7): a node the spec ranks
        strictly first, the backend ranks strictly first too; ties are free, and so are the units of its clock and
        counters. A backend whose metadata is in the spec's units (`metadata_exact`) has each node's rank equal the
        spec's: the profile pins SGLang's updates, so a count off by one everywhere is a difference too. Eviction
        order shows a stamp, count or priority only once it decides between two leaves, often many steps later;
        this sees it at once. The root's metadata is never read, and is not compared."""
        if not self.capabilities.reports_metadata or not profile(self.capabilities.profile).pinned(RANK):
            return []
        policy, nodes, params = self.config.policy, oracle.nodes, self.config.policy_params()
        tlru = policy == "tlru"  # its rank also reads the node's place in its tree, and its history (SPEC.md §4.5)
        theirs = {  # the oracle's snapshot (`spec`) names its nodes by id, its paths derived once
            p: ((n.last_access, n.hit_count, n.creation, n.priority), len(n.key), n.history)
            for i, p in contracts.node_paths(spec).items()
            if i != spec.root
            for n in (nodes[i],)
        }
        paths = contracts.node_paths(snap)
        seen = [
            (paths[n.id], n.meta, n.history, len(n.key), want)
            for n in snap.nodes
            if n.id != snap.root and n.meta is not None
            for want in (theirs.get(paths.get(n.id)),)  # type: ignore[arg-type]
            if want is not None
        ]
        if tlru:
            lacking = next((path for path, _, history, _, _ in seen if history is None), None)
            if lacking is not None:
                return [
                    Violation(
                        "INV-META-1",
                        f"tlru: the node at {lacking[1][-4:]}@{len(lacking[1])} reports metadata but no history "
                        "(NodeView.history): its T-LRU rank cannot be computed without it, and the check does not guess it",
                    )
                ]

        def rank(meta: tuple[int, int, int, int], depth: int, size: int, history: Optional[int]) -> tuple[int, ...]:
            # Only tlru reads the node's place and history; every other policy's rank ignores them (policy_rank's
            # contract), so both sides pass them alike.
            return pages.policy_rank(policy, *meta, **params, depth=depth, size=size, history=history or 0)

        ranks = [
            (rank(w[0], len(path[1]), w[1], w[2]), rank(m, len(path[1]), size, h)) for path, m, h, size, w in seen
        ]

        def shown(meta: tuple[int, int, int, int], history: Optional[int]) -> str:
            return f"{meta} history {history}" if tlru else str(meta)

        what = "(last_access, hit_count, creation, priority)"
        if self.capabilities.metadata_exact:
            for (path, meta, history, _, want), (theirs_rank, mine_rank) in zip(seen, ranks):
                if mine_rank != theirs_rank:
                    return [
                        Violation(
                            "INV-META-1",
                            f"node at {path[1][-4:]}@{len(path[1])} has {policy} metadata {what} "
                            f"{shown(meta, history)}, the spec's {shown(want[0], want[2])}",
                        )
                    ]
            return []
        breach = contracts.order_breach(ranks)
        if breach is None:
            return []
        (a, a_meta, a_hist, _, a_want), (b, b_meta, b_hist, _, b_want) = seen[breach[0]], seen[breach[1]]
        return [
            Violation(
                "INV-META-1",
                f"{policy}: the spec ranks the node at {a[1][-4:]}@{len(a[1])} before the one at {b[1][-4:]}@{len(b[1])} "
                f"(metadata {what} {shown(a_want[0], a_want[2])}, {shown(b_want[0], b_want[2])}); the backend's "
                f"{shown(a_meta, a_hist)}, {shown(b_meta, b_hist)} do not",
            )
        ]

    def rows(self, snap: Snapshot) -> list[Violation]:
        """INV-REQ-2: each running request's row reads the tree's own slots for the prefix it protects (its lock keeps
        them there: a checkpoint that left the row on the duplicates it freed reads memory anyone may take), and the
        slots it still owns hold its KV (SPEC.md §4.8), one read a step. The tree's part's bytes are judged as the
        tree's (INV-KV-1, once a load into them lands)."""
        if not self.ledger.running:
            return []
        out = []
        for k, (r, _) in sorted(self.ledger.running.items()):
            if r is None or not r.protected:
                continue
            cached = contracts.cached_prefix_len(snap, r.namespace, r.tokens)
            tree = contracts.prefix_slots(snap, r.namespace, r.tokens, min(cached, r.protected))
            if cached < r.protected or tuple(r.row[: r.protected]) != tree:
                out.append(
                    Violation(
                        "INV-REQ-2",
                        f"request {k}: its row reads {tuple(r.row[: r.protected])} for its {r.protected} protected "
                        f"tokens, the tree holds {tree}" + ("" if cached >= r.protected else f" ({cached} cached)"),
                    )
                )
        if out or not self.capabilities.kv_reads:
            return out
        checks = []
        for k, (r, _) in sorted(self.ledger.running.items()):
            if r is None:  # ended on the backend's side
                continue
            content = self.model.content(r.namespace, tuple(r.tokens))
            want = content[r.protected :] if content is not None else ()
            if want:
                checks.append((k, r, want))
        got = _read_batched(self.backend.read_kv, [r.row[r.protected :] for _, r, _ in checks])  # type: ignore[attr-defined]
        self.kv_entries_read += sum(len(have) for have in got)
        for (k, r, want), have in zip(checks, got):
            if have == list(want):
                continue
            bad = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), None)
            if bad is not None:
                out.append(
                    Violation(
                        "INV-REQ-2",
                        f"request {k}: its own slot {r.row[r.protected + bad]} (token {r.protected + bad}) holds other KV",
                    )
                )
        return out

    def copy_contents(self, snap: Snapshot, oracle: RefCache, spec_snap: Snapshot) -> list[Violation]:
        """INV-COPY-1: each pending copy moves the spec's nodes (by path), splits included."""
        if not snap.pending:
            return []
        mine, spec = contracts.node_paths(snap), contracts.node_paths(spec_snap)
        for got, want in zip(snap.pending, oracle.copies):
            have = {mine.get(i) for i in got.nodes}
            need = {spec[n.id] for n in want.nodes}
            if have != need:

                def ends(paths: Any) -> str:  # each node as its path's last tokens @ its length, with its namespace
                    names = sorted(
                        (len(p[1]), f"{p[1][-4:]}@{len(p[1])}" + (f" in {p[0]!r}" if p[0] is not None else ""))
                        for p in paths
                        if p
                    )
                    return "[" + ", ".join(n for _, n in names) + "]"

                return [
                    Violation(
                        "INV-COPY-1",
                        f"pending {got.kind} copy {got.id} moves the nodes {ends(have)}; the spec's moves "
                        f"{ends(need)} (missing {ends(need - have)}, extra {ends(have - need)})",
                    )
                ]
        return []

    def storage(self, storages: tuple[FaultyStorage, ...]) -> list[Violation]:
        """INV-STORE-1: the backend stored exactly the spec's pages, under the spec's keys, with its bytes."""
        if not storages:
            return []
        mine, spec = storages[0].inner.contents(), storages[1].inner.contents()
        if mine == spec:
            return []
        extra, missing = sorted(set(mine) - set(spec)), sorted(set(spec) - set(mine))
        wrong = sorted(k for k in set(mine) & set(spec) if mine[k] != spec[k])
        return [
            Violation(
                "INV-STORE-1",
                f"storage differs from the spec's: {len(extra)} extra keys, {len(missing)} missing, "
                f"{len(wrong)} with other bytes" + (f" (e.g. {(extra + missing + wrong)[0][:16]}…)"),
            )
        ]

    def kv(self, snap: Snapshot) -> list[Violation]:
        """INV-KV-1/2/3: every settled slot of both tiers, and every retraction backup, holds its content.

        One `read_kv` and one `read_host_kv` call per step over every slot to check (a torch backend
        gathers them in one index operation); the results are then compared in node order.
        """
        if not self.capabilities.kv_reads:
            return []
        loading = {n for c in snap.pending if c.kind == "load" for n in c.nodes}
        writing = {n for c in snap.pending if c.kind == "write" for n in c.nodes}
        paths = contracts.node_paths(snap)
        checks: list[tuple[str, int, int, tuple[int, ...], tuple[bytes, ...]]] = []
        """(invariant, path length or backup index, edge length, slots, the entries they must hold), in report order."""
        for node in snap.nodes:
            if node.id == snap.root or node.id not in paths or not node.key:
                continue
            ns, path = paths[node.id]
            content = self.model.content(ns, path)
            if content is None:
                continue  # a key the spec never caches (a lenient backend took bad input): it has no content
            want = content[len(path) - len(node.key) :]
            if node.slots is not None and node.id not in loading:
                checks.append(("INV-KV-1", len(path), len(node.key), node.slots, want))
            if node.host_slots is not None and node.id not in writing:
                checks.append(("INV-KV-2", len(path), len(node.key), node.host_slots, want))
        for view in snap.retractions:
            k = self.ledger.retractions.number_of(view.id)
            want_r = self.ledger.retraction_kv.get(k) if k is not None else None
            if k is not None and want_r is not None:
                checks.append(("INV-KV-3", k, 0, view.host_slots[: view.tokens], want_r))
        on_device = [c for c in checks if c[0] == "INV-KV-1"]
        on_host = [c for c in checks if c[0] != "INV-KV-1"]
        device_flat = _read_flat(self.backend.read_kv, [c[3] for c in on_device])  # type: ignore[attr-defined]
        host_flat = _read_flat(self.backend.read_host_kv, [c[3] for c in on_host])  # type: ignore[attr-defined]
        self.kv_entries_read += len(device_flat) + len(host_flat)
        chain = itertools.chain.from_iterable
        if device_flat == list(chain(c[4] for c in on_device)) and host_flat == list(chain(c[4] for c in on_host)):
            return []  # every byte as the spec says: one comparison per tier (the common case)
        device = iter(_split(device_flat, [c[3] for c in on_device]))
        host = iter(_split(host_flat, [c[3] for c in on_host]))
        out: list[Violation] = []
        for inv, length, edge, slots, want in checks:
            got = next(device) if inv == "INV-KV-1" else next(host)
            if got == list(want):
                continue
            if inv == "INV-KV-1" and len(got) != len(want):  # a lenient backend kept a node short of its slots
                out.append(
                    Violation(inv, f"the node ending at {length} tokens holds {len(got)} slots for its {len(want)} tokens")
                )
            elif inv == "INV-KV-1":
                bad = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
                out.append(
                    Violation(
                        inv,
                        f"device slot {slots[bad]} of the node ending at "
                        f"{length} tokens holds other KV than token {length - edge + bad}'s",
                    )
                )
            elif inv == "INV-KV-2":
                out.append(Violation(inv, f"the host copy of the node ending at {length} tokens holds other KV"))
            else:
                out.append(Violation(inv, f"retraction backup {length} holds other KV than it was made from"))
        return out

    def kv_pages(self, table: PageTable) -> list[Violation]:
        """INV-KV-1 over a page table: every cached page's slots hold the KV of its last page of tokens, computed over
        all of them under its keys."""
        if not self.capabilities.kv_reads:
            return []
        ps = table.page_size
        checks: list[tuple[CachedPage, tuple[bytes, ...]]] = []
        for page in table.pages:
            content = self.model.content(page.namespace, page.tokens)
            if content is not None:
                checks.append((page, tuple(content[len(page.tokens) - ps :])))
        flat = _read_flat(self.backend.read_kv, [p.slots for p, _ in checks])  # type: ignore[attr-defined]
        self.kv_entries_read += len(flat)
        if flat == list(itertools.chain.from_iterable(want for _, want in checks)):
            return []
        out: list[Violation] = []
        for (page, want), got in zip(checks, _split(flat, [p.slots for p, _ in checks])):
            if tuple(got) != want:
                bad = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), len(got))
                out.append(
                    Violation(
                        "INV-KV-1",
                        f"slot {page.slots[bad] if bad < len(page.slots) else '?'} of page {page.id} (tokens "
                        f"{len(page.tokens) - ps}-{len(page.tokens) - 1} under {page.namespace!r}) holds other KV than "
                        f"token {len(page.tokens) - ps + bad}'s",
                    )
                )
        return out[:5]


def same_state(a: Snapshot, b: Snapshot) -> bool:
    """Equal as far as the spec can tell (ids and free-list order are the backend's business)."""
    return (
        contracts.shape(a) == contracts.shape(b)
        and contracts.page_slots(a) == contracts.page_slots(b)
        and set(a.free_slots) == set(b.free_slots)
        and set(a.host_free_slots) == set(b.host_free_slots)
        and [(c.kind, c.finished) for c in a.pending] == [(c.kind, c.finished) for c in b.pending]
        and [r.tokens for r in a.retractions] == [r.tokens for r in b.retractions]
        and contracts.session_paths(a) == contracts.session_paths(b)
        and a.tier_evictable == b.tier_evictable
        and (a.evictable_size, a.protected_size) == (b.evictable_size, b.protected_size)
    )


def _read_batched(read: Callable[[tuple[int, ...]], Any], runs: list[tuple[int, ...]]) -> list[list[bytes]]:
    """`read` over every run at once, split back into one list per run."""
    return _split(_read_flat(read, runs), runs)


def _read_flat(read: Callable[[tuple[int, ...]], Any], runs: list[tuple[int, ...]]) -> list[bytes]:
    """`read` over every run at once (none for no runs)."""
    return list(read(tuple(itertools.chain.from_iterable(runs)))) if runs else []


def _split(flat: list[bytes], runs: list[tuple[int, ...]]) -> list[list[bytes]]:
    """`flat` cut back into one list per run (a short read leaves the last runs short)."""
    out, at = [], 0
    for run in runs:
        out.append(flat[at : at + len(run)])
        at += len(run)
    return out


def retention_violations(snap: Snapshot, spec: Snapshot) -> list[Violation]:
    """INV-RET-2/3 (SPEC.md §11.7) against the oracle's snapshot: a retained session demoted where the spec demoted
    none or another, and retention deadlines that differ (one outliving its TTL, its release or the next turn)."""
    out = []
    theirs = {x.id for x in spec.sessions if x.demoted}
    wrong = [x.id for x in snap.sessions if x.demoted and x.id not in theirs and x.retained_until is not None]
    if wrong:
        out.append(Violation("INV-RET-2", f"retained sessions {wrong} demoted; the spec demotes {sorted(theirs)}"))
    mine_ru = [(x.id, x.retained_until, x.waiting) for x in snap.sessions]
    spec_ru = [(x.id, x.retained_until, x.waiting) for x in spec.sessions]
    if mine_ru != spec_ru:
        differ = next((a, b) for a, b in itertools.zip_longest(mine_ru, spec_ru) if a != b)
        out.append(Violation("INV-RET-3", f"session (id, retained until, waiting) {differ[0]}, spec says {differ[1]}"))
    return out
