"""The engine zoo's catalogue (`conformance.zoo.engines` runs it): textual mutants of kvcert's reference engines, one
real bug class each, with the directed traces of those generation reaches at some seeds only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvcert.spec.ops import Flush, LinkerFault, Op, Step, Submit
from kvcert.spec.types import CacheConfig

__all__ = ["ENGINE_MUTANTS", "DirectedTrace", "EngineMutant"]


@dataclass(frozen=True)
class DirectedTrace:
    """Request-path ops (`kvcert.spec.ops.REQUEST_OPS`) that the unmodified engine passes and the mutant fails under
    one of its rules; the harness quiesces after the last op."""

    config: CacheConfig
    ops: tuple[Op, ...]
    why: str = ""


@dataclass(frozen=True)
class EngineMutant:
    name: str
    doc: str
    """The real bug class it reproduces."""
    edits: tuple[tuple[str, str], ...]
    """(find, replace) pairs; each `find` occurs exactly once in the module's source."""
    rules: frozenset[str]
    """The rules expected to catch it: a kill under any other rule is reported, not counted."""
    module: str = "engine_linker"
    trace: Optional[DirectedTrace] = None
    """For a bug class generation reaches at some seeds only, or not at all, at the zoo's budget: the trace that
    kills it (generation is still tried and reported)."""
    page_sizes: tuple[int, ...] = (1, 4)
    policies: tuple[str, ...] = ("lru",)
    budget: int = 1
    """Examples per cell, as a multiple of the zoo's (the control runs the largest)."""
    factory: str = "factory"
    """The module's factory it runs: `factory` (over the reference model) or `factory_gpu` (over kvcert.gpu)."""
    profile: Optional[str] = None
    """The profile it is held to instead of the engine's own (SPEC.md §6); the control is held to it too."""


# ------------------------------------------------------------------ directed traces

_CONFIG = CacheConfig(page_size=4, capacity=96, host_capacity=0)
_PROMPT = tuple([1] * 4 + [2] * 4 + [3] * 4 + [0] * 4 + [1] * 4)
_FLOODS = (tuple([2] * 44), tuple([3] * 44), tuple([0, 0, 0, 1] * 11))
"""Three long prompts that leave nothing of `_PROMPT` on the 96-slot device (tests/_linker.py's conversation)."""


def _run(request: str, prompt: tuple[int, ...], steps: int = 12) -> tuple[Op, ...]:
    return (Submit(request, None, prompt, 0, 2), *[Step()] * steps)


_EVICTED: tuple[Op, ...] = _run("r00", _PROMPT) + sum((_run(f"r0{i + 1}", f) for i, f in enumerate(_FLOODS)), ())
"""`_PROMPT` computed, offloaded and then evicted from the device: its pages are the store's only."""

_SMALL = CacheConfig(page_size=4, capacity=32, host_capacity=0)
_TWIN = tuple([5] * 8 + [6])
"""Two pages and a token: a prompt two requests send at once."""

# ------------------------------------------------------------------ the table

_ADMITTED_LOAD = (
    "        if n and self.store.load(r.id, tail[:n], r.row[r.computed : r.computed + n * self.ps]):\n"
    "            self.loading[r.id] = n * self.ps\n"
)

ENGINE_MUTANTS: tuple[EngineMutant, ...] = (
    EngineMutant(
        "load_past_lookup",
        "loads one page past the longest prefix the lookup reported (the page it hopes the store fetches meanwhile)",
        (
            (
                _ADMITTED_LOAD,
                "        if n and n < len(tail) and self.store.load(r.id, tail[: n + 1], "
                "r.row[r.computed : r.computed + (n + 1) * self.ps]):\n"
                "            self.loading[r.id] = n * self.ps\n",
            ),
        ),
        frozenset({"INV-LINK-1"}),
    ),
    EngineMutant(
        "load_into_tree_slots",
        "a load's destination ignores the device-cached prefix: it lands at the row's start, in the tree's slots",
        (
            (
                "r.row[r.computed : r.computed + n * self.ps]):",
                "r.row[: n * self.ps]):",
            ),
        ),
        frozenset({"INV-LINK-2"}),
        trace=DirectedTrace(
            _CONFIG,
            _EVICTED
            + _run("r04", _PROMPT[:8] + (5, 5))  # loads _PROMPT's first two pages back; they are cached again
            + (Submit("r99", None, _PROMPT + (2, 2, 2, 2), 0, 2),),  # a device prefix, then the store's pages
            "a store hit behind a device prefix: generation leaves just a prompt's head on the device at some seeds only",
        ),
        factory="factory_gpu",  # the reference model refuses a write into slots it did not lend (INV-RP-1)
    ),
    EngineMutant(
        "second_load",
        "the admission hook runs twice for a request (a retry after a lookup): a second load queued beside the first",
        (
            (
                "        hits = self.store.lookup(r.id, tail)\n        n = max(hits, default=0)\n" + _ADMITTED_LOAD,
                "        for _ in range(2):\n"
                "            hits = self.store.lookup(r.id, tail)\n"
                "            n = max(hits, default=0)\n"
                "            if n and self.store.load(r.id, tail[:n], r.row[r.computed : r.computed + n * self.ps]):\n"
                "                self.loading[r.id] = n * self.ps\n",
            ),
        ),
        frozenset({"INV-LINK-2"}),
    ),
    EngineMutant(
        "batch_never_finished",
        "only the error path finishes (releases) a batch: one that landed is read off its counter and never finished",
        (
            (
                "        landed = self.store.finish(batch)\n",
                "        landed = self.store.batches.get(batch, True) or self.store.finish(batch)\n",
            ),
        ),
        frozenset({"INV-LINK-3", "INV-LINK-7"}),
    ),
    EngineMutant(
        "batch_finished_per_request",
        "a batch is finished once per request in it instead of once",
        (
            (
                "        landed = self.store.finish(batch)\n",
                "        landed = all([self.store.finish(batch) for _ in self.loading])\n",
            ),
        ),
        frozenset({"INV-LINK-3"}),
        trace=DirectedTrace(
            _CONFIG,
            _EVICTED
            + (Submit("r98", None, _PROMPT + (2, 2, 2, 2), 0, 2), Submit("r99", None, _PROMPT + (3, 3, 3, 3), 0, 2))
            + (Step(),),
            "two loads in one batch (two requests admitted in one step, both hitting the store): not generated at this "
            "budget",
        ),
    ),
    EngineMutant(
        "serve_failed_load",
        "a failed batch is taken as landed (the counter's presence is checked, not its value): the request computes "
        "past the torn bytes",
        (("        landed = self.store.finish(batch)\n", "        landed = self.store.finish(batch) is not None\n"),),
        frozenset({"INV-LINK-4"}),
        trace=DirectedTrace(
            _CONFIG,
            _EVICTED + (LinkerFault("load_fail"), Submit("r99", None, _PROMPT + (2, 2, 2, 2), 0, 2)),
            "a store hit right after a `load_fail`: generation reaches it at some seeds only",
        ),
        profile="sglang-0.5.23",  # aborts_failed_loads: INV-LINK-4 judges the request itself (core sees INV-KV-1)
    ),
    EngineMutant(
        "offload_unpinned",
        "the offload's node is unlocked once the copy is queued, not once its result is taken",
        (
            (
                "        self.offloads.append((got.node, picked))\n",
                "        self.cache.dec_lock_ref(got.node)\n        self.offloads.append((got.node, picked))\n",
            ),
            ("            self.cache.dec_lock_ref(node)\n", ""),
        ),
        frozenset({"INV-LINK-5", "INV-HOST-6"}),  # HOST-6 sees the unlocked pending copy before a byte changes
    ),
    EngineMutant(
        "offload_from_row",
        "an offload copies from the request's row, whose pages the tree already held were freed as duplicates at "
        "insert: the copy reads slots reused meanwhile",
        (
            (
                "        slots = [s for i in new for s in got.slots[i * self.ps : (i + 1) * self.ps]]\n",
                "        slots = [s for i in new for s in r.row[i * self.ps : (i + 1) * self.ps]]\n",
            ),
        ),
        frozenset({"INV-LINK-5"}),
        trace=DirectedTrace(
            _SMALL,
            (
                LinkerFault("offload_refuse"),  # the first twin's offload is refused: its pages stay unstored
                LinkerFault("offload_hold"),  # the second twin's (from freed slots) stays in flight 3 steps
                Submit("a", None, _TWIN, 0, 1),
                Submit("b", None, _TWIN, 0, 1),
                Step(),
                Submit("c", None, tuple([7] * 16), 0, 1),  # reuses the freed slots while the copy is in flight
                *[Step()] * 4,
            ),
            "twins finishing together, the first one's offload refused, the second's held: not generated at this "
            "budget",
        ),
    ),
    EngineMutant(
        "stored_on_failure",
        "a node is marked stored whatever its offload's result",
        (
            (
                "            if self.store.pop():\n                self.stored",
                "            self.store.pop()\n            self.stored",
            ),
        ),
        frozenset({"INV-LINK-6"}),
        page_sizes=(4,),
    ),
    EngineMutant(
        "results_out_of_order",
        "the engine's offload bookkeeping is a stack: the oldest result is credited to the newest offload",
        (("            node, keys = self.offloads.pop(0)\n", "            node, keys = self.offloads.pop()\n"),),
        frozenset({"INV-LINK-6"}),
        trace=DirectedTrace(
            _SMALL,
            (
                LinkerFault("offload_fail"),
                Submit("a", None, _TWIN, 0, 1),
                Submit("b", None, tuple([6] * 8 + [5]), 0, 1),
                *[Step()] * 3,
            ),
            "two offloads taken in one step, the older one failed: generation reaches it at some seeds only",
        ),
    ),
    EngineMutant(
        "takes_unpublished_results",
        "a result is taken for every offload in flight, not only for those published",
        (("        for _ in range(self.store.completed()):\n", "        for _ in range(len(self.offloads)):\n"),),
        frozenset({"INV-LINK-6"}),
    ),
    EngineMutant(
        "load_left_queued",
        "a one-page hit is recomputed instead, dropped from the engine's books without cancelling the queued load, "
        "and a batch is started only when the engine waits for loads of its own",
        (
            (_ADMITTED_LOAD, _ADMITTED_LOAD.replace("):\n", ") and n > 1:\n")),
            ("        if not self.loading:\n            self.store.start()\n", "        if not self.loading:\n"),
        ),
        frozenset({"INV-LINK-7", "INV-LINK-3"}),
    ),
    EngineMutant(
        "newest_result_left",
        "an off-by-one in the take loop: the newest published result waits for the next one, its node locked, and "
        "the last offload's is never taken",
        (
            (
                "        for _ in range(self.store.completed()):\n",
                "        for _ in range(self.store.completed() - 1):\n",
            ),
        ),
        frozenset({"INV-LINK-7", "INV-LIVE-1"}),
    ),
    EngineMutant(
        "flush_keeps_offload_locks",
        "a flush resets the store and forgets the offloads in flight, but never unlocks their nodes",
        (("        for held, _ in self.offloads:  # their results will never be taken: the store forgets them\n"
          "            self.cache.dec_lock_ref(held)\n", ""),),  # fmt: skip
        frozenset({"INV-LINK-7", "INV-LIVE-1"}),
        trace=DirectedTrace(
            _CONFIG,
            (LinkerFault("offload_hold"), Submit("r01", None, _PROMPT[:12], 0, 2), *[Step()] * 3, Flush(),
             *[Step()] * 4),  # fmt: skip
            "a flush while an offload is held: generation flushes mostly once every offload was taken",
        ),
    ),
    EngineMutant(
        "dest_one_page_early",
        "the destination starts a page early, on the promised prefix's last page: the prefill overwrites KV the tree "
        "holds",
        (
            (
                "            dest = own[: len(r.tokens) - got.length]\n",
                "            dest = (list(got.slots[-self.ps :]) + own)[: len(r.tokens) - got.length]\n",
            ),
        ),
        frozenset({"INV-DEC-1"}),
        module="engine_decode",
    ),
    EngineMutant(
        "prefix_lock_on_root",
        "the promised prefix's lock is taken on the wrong node (the root): eviction may take tokens the prefill skips",
        (
            (
                "            self.cache.inc_lock_ref(got.node)\n            need = final - got.length\n",
                "            held = self.cache.snapshot().root\n            self.cache.inc_lock_ref(held)\n"
                "            need = final - got.length\n",
            ),
            (
                "                self.cache.dec_lock_ref(got.node)\n                return\n            own",
                "                self.cache.dec_lock_ref(held)\n                return\n            own",
            ),
            (
                "r.row, r.protected, r.node = list(got.slots) + own, got.length, got.node",
                "r.row, r.protected, r.node = list(got.slots) + own, got.length, held",
            ),
        ),
        frozenset({"INV-DEC-2", "INV-DEC-3"}),
        module="engine_decode",
    ),
    EngineMutant(
        "lock_gap_in_transfer",
        "the prefix lock is dropped once the promise is sent and taken again at the commit (a lock handoff with a gap)",
        (
            (
                "            self.transfers.append(_Transfer(r, got.length, dest, self.steps))\n",
                "            self.transfers.append(_Transfer(r, got.length, dest, self.steps))\n"
                "            self.cache.dec_lock_ref(got.node)\n",
            ),
            (
                "            _, cached, locked = self._facts()\n            self.ledger.commit(",
                "            self.cache.inc_lock_ref(r.node)\n            _, cached, locked = self._facts()\n"
                "            self.ledger.commit(",
            ),
        ),
        frozenset({"INV-DEC-3"}),
        module="engine_decode",
    ),
    EngineMutant(
        "dest_out_of_row_order",
        "the destination pages are sent sorted otherwise than the row reads them (an allocator that sorts what it "
        "hands out): the prefill's bytes land out of order",
        (
            (
                "            dest = own[: len(r.tokens) - got.length]\n",
                "            dest = sorted(own[: len(r.tokens) - got.length], reverse=True)\n",
            ),
        ),
        frozenset({"INV-DEC-4"}),
        module="engine_decode",
    ),
    EngineMutant(
        "failed_transfer_cached",
        "a transfer the peer failed is finished as if it landed: its torn destination is inserted into the tree",
        (
            (
                '                self._end(r, "aborted")\n                self.ledger.fail(',
                '                r.computed = len(r.tokens)\n                self._end(r, "finished")\n'
                "                self.ledger.fail(",
            ),
        ),
        frozenset({"INV-DEC-5"}),
        module="engine_decode",
    ),
    EngineMutant(
        "never_fit_waits",
        "no check at arrival: a request that can never fit waits at the head of the queue, and starves every request "
        "behind it",
        (
            (
                "            if pages.page_ceil(len(tokens) + output, self.ps) > self.config.capacity:\n",
                "            if False:\n",
            ),
        ),
        frozenset({"INV-DEC-6"}),
        module="engine_decode",
    ),
)
